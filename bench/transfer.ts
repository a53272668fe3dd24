/** Transfer benchmark (`npm run bench -- transfer [--json FILE]`), four ratios measured in one run,
 *  each the median of per-repeat ratios of its two sides measured beside each other (the order
 *  alternating), with its spread (`NAME_spread`: min, quartiles, max, n; bench/ratio.ts):
 *  - `transfer_vs_loopback_ratio`: P → D throughput of a 1,000-token prompt's KV (kvfence's framed,
 *    checksummed, authenticated transfer, from a KV pool into a KV pool in another Node process)
 *    ÷ raw loopback TCP carrying the same bytes between the same two processes. Target ≥ 0.7.
 *  - `tls_vs_plain_transfer_ratio`: the same transfer over mutual TLS 1.3 (certificates made in
 *    memory, as `kvfence certs init` makes them) ÷ over plaintext TCP, alternating. Target ≥ 0.6.
 *  - `view_vs_copy_path_ratio`: the transfer as the prefill worker sends it (each page from the
 *    pool as it lies, `viewPage`: its per-layer slices written and hashed in place) ÷ the same
 *    transfer gathering each page into one buffer first (`readPage` alone), alternating; with
 *    `sender_cpu_s_per_gb_view_path` / `_copy_path`, this process's (P's) CPU seconds per GB sent.
 *  - `checksum_vs_memcpy_ratio`: xxh64 (`pageChecksum`) over the pages ÷ copying the same pages.
 *    Target ≥ 0.5. `xxh3_vs_xxh64_ratio`: the same package's xxh3 (64-bit) ÷ xxh64 over the same
 *    pages (the case for or against changing the wire's checksum kind).
 *  - `guard_overhead_ratio`: decode tokens/s of the bundled model with every guard on ÷ all off
 *    (single-process engine, same prompt, alternating runs). Target ≥ 0.98.
 *
 *  The KV shape defaults to SmolLM2-135M's (30 layers, 3 KV heads of 64: 45 KiB per token, 44 MiB
 *  for 1,000 tokens), so that the transfer moves a realistic amount of data; the bundled model's KV
 *  would be 1 MiB. Args: `--tokens N` (1000), `--repeats N` (7), `--layers N` (30), `--kv-heads N`
 *  (3), `--head-dim N` (64), `--page-size N` (16), `--decode-tokens N` (300), `--decode-repeats N`
 *  (15), and the sender's `--pages-per-frame N` (8), `--bytes-in-flight N` (4 MiB), `--write-bytes N`
 *  (256 KiB).
 *
 *  The decode worker side runs in a child process: this module forks itself with
 *  `--kvfence-transfer-bench-child` and serves the transfer receivers (plaintext and TLS) and a raw
 *  TCP sink there. */
import { fork, type ChildProcess } from 'node:child_process'
import { randomBytes } from 'node:crypto'
import { xxh3 } from '@node-rs/xxhash'
import net from 'node:net'
import { fileURLToPath } from 'node:url'
import { createAuthority, issuePartCert, validityDays } from '../src/cli/certs.js'
import { buildFaultConfig } from '../src/engine/faults.js'
import { generateLocal } from '../src/engine/local-engine.js'
import { createWorkerCore, gatherPage, pageSlices, scatterPage } from '../src/engine/worker-core.js'
import { makeGuards } from '../src/kv/guards.js'
import { KvPool, type PoolShape } from '../src/kv/pool.js'
import { loadModel } from '../src/model/weights.js'
import type { TlsMaterial } from '../src/link/tls.js'
import { pageChecksum } from '../src/transfer/checksum.js'
import { TransferClient, TransferServer } from '../src/transfer/index.js'
import { echoModelDir } from '../test/helpers/paths.js'
import { interleavedPairsSync, pairRatios, ratioFields } from './ratio.js'

const childFlag = '--kvfence-transfer-bench-child'
const secret = Buffer.alloc(32, 7) // a fixed per-run secret shared with the child (benchmark only)

function median(xs: number[]): number {
  const s = [...xs].sort((a, b) => a - b)
  const mid = s.length >> 1
  return s.length % 2 ? s[mid] : (s[mid - 1] + s[mid]) / 2
}

function flag(args: string[], name: string, fallback: number): number {
  const at = args.indexOf(name)
  if (at < 0) return fallback
  const value = Number(args[at + 1])
  if (!Number.isInteger(value) || value < 1)
    throw new Error(`${name} needs a positive integer, got ${args[at + 1]}`)
  return value
}

interface Shape extends PoolShape {
  numTokens: number
}

// ─── The child: D's transfer receiver and a raw TCP sink ──────────────────────────────────────

/** TLS files of the benchmark's two parts, as PEM text (to cross the process boundary). */
interface BenchTls {
  ca: string
  decode: { cert: string; key: string }
  prefill: { cert: string; key: string }
}

async function makeBenchTls(): Promise<BenchTls> {
  const validity = validityDays(1)
  const ca = await createAuthority(validity)
  const part = async (name: string) => {
    const issued = await issuePartCert(ca, name, ['127.0.0.1'], validity)
    return { cert: issued.certPem, key: issued.keyPem }
  }
  return { ca: ca.certPem, decode: await part('decode'), prefill: await part('prefill') }
}

function material(tls: BenchTls, part: 'decode' | 'prefill'): TlsMaterial {
  return {
    ca: Buffer.from(tls.ca),
    cert: Buffer.from(tls[part].cert),
    key: Buffer.from(tls[part].key),
  }
}

/** Child process: TransferServers (plaintext, and TLS) writing into a pool of `shape`, and a raw
 *  sink that answers one byte each time it received `expectBytes` bytes. Reports the ports. */
async function runChild(): Promise<void> {
  const shape = JSON.parse(process.argv[process.argv.indexOf(childFlag) + 1]) as Shape
  const tls = JSON.parse(process.argv[process.argv.indexOf(childFlag) + 2]) as BenchTls
  const pool = new KvPool(shape, makeGuards(true))
  const numPages = Math.ceil(shape.numTokens / shape.pageSize)
  const hooks: ConstructorParameters<typeof TransferServer>[0] = {
    secretFor: () => secret,
    begin: () => {
      const lease = pool.allocate(numPages, 1, 1)
      pool.pin(lease)
      // As on a real decode worker, the pages are freed (and scrubbed) later, not before the ACK.
      const done = () => {
        pool.unpin(lease)
        setImmediate(() => pool.release(lease))
      }
      return {
        pageSize: shape.pageSize,
        writePage: (ordinal, tokens, payload) => {
          pool.noteWrite(lease, ordinal * shape.pageSize, tokens)
          scatterPage(pool, lease.pages[ordinal].page, payload)
        },
        placePage: (ordinal, tokens) => {
          pool.noteWrite(lease, ordinal * shape.pageSize, tokens)
          return pageSlices(pool, lease.pages[ordinal].page)
        },
        complete: done,
        abort: done,
      }
    },
  }
  const server = new TransferServer(hooks)
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  const tlsServer = new TransferServer(hooks, { tls: material(tls, 'decode') })
  await new Promise<void>((resolve) => tlsServer.listen(0, '127.0.0.1', resolve))
  const expectBytes = numPages * pool.pageBytes
  const sink = net.createServer({ noDelay: true }, (socket) => {
    let received = 0
    socket.on('data', (chunk: Buffer) => {
      received += chunk.length
      while (received >= expectBytes) {
        received -= expectBytes
        socket.write(Buffer.of(1))
      }
    })
  })
  await new Promise<void>((resolve) => sink.listen(0, '127.0.0.1', resolve))
  process.send!({
    transferPort: server.port,
    tlsTransferPort: tlsServer.port,
    sinkPort: (sink.address() as net.AddressInfo).port,
  })
  process.on('disconnect', () => process.exit(0))
}

if (process.argv.includes(childFlag)) void runChild()

// ─── The parent: P ───────────────────────────────────────────────────────────────────────────

interface ChildPorts {
  transferPort: number
  tlsTransferPort: number
  sinkPort: number
}

async function startChild(
  shape: Shape,
  tls: BenchTls,
): Promise<{ child: ChildProcess } & ChildPorts> {
  const child = fork(
    fileURLToPath(import.meta.url),
    [childFlag, JSON.stringify(shape), JSON.stringify(tls)],
    { stdio: ['ignore', 'inherit', 'inherit', 'ipc'] },
  )
  const ports = await new Promise<ChildPorts>((resolve, reject) => {
    child.once('message', (m) => resolve(m as ChildPorts))
    child.once('exit', (code) => reject(new Error(`benchmark child exited with code ${code}`)))
  })
  return { child, ...ports }
}

/** One P → D transfer of the whole prompt: its seconds, and this process's (P's) CPU seconds.
 *  `path` `view` sends the pages from the pool as they lie (`viewPage`, the prefill worker's
 *  path); `copy` gathers each page into one buffer first (`readPage` alone). */
async function timeTransfer(
  client: TransferClient,
  pool: KvPool,
  shape: Shape,
  path: 'view' | 'copy' = 'view',
): Promise<{ seconds: number; cpuSeconds: number }> {
  const numPages = Math.ceil(shape.numTokens / shape.pageSize)
  const tokensOn = (ordinal: number) =>
    Math.min(shape.pageSize, shape.numTokens - ordinal * shape.pageSize)
  const cpu0 = process.cpuUsage()
  const t0 = performance.now()
  await client.send({
    transferId: randomBytes(16).toString('hex'),
    requestId: randomBytes(16).toString('hex'),
    tenant: 'bench',
    numTokens: shape.numTokens,
    numPages,
    pageBytes: pool.pageBytes,
    secret,
    firstTokenId: 1,
    readPage: (ordinal, dst) => {
      gatherPage(pool, ordinal, dst)
      return tokensOn(ordinal)
    },
    ...(path === 'view' && {
      viewPage: (ordinal: number) => ({
        tokensOnPage: tokensOn(ordinal),
        views: pageSlices(pool, ordinal),
      }),
    }),
  })
  const seconds = (performance.now() - t0) / 1000
  const cpu = process.cpuUsage(cpu0)
  return { seconds, cpuSeconds: (cpu.user + cpu.system) / 1e6 }
}

/** Seconds to push `numBytes` through a raw socket in 1 MiB writes until the sink's one-byte reply. */
async function timeRaw(socket: net.Socket, numBytes: number, chunk: Buffer): Promise<number> {
  const t0 = performance.now()
  const replied = new Promise<void>((resolve) => socket.once('data', () => resolve()))
  let left = numBytes
  while (left > 0) {
    const n = Math.min(left, chunk.length)
    left -= n
    if (!socket.write(n === chunk.length ? chunk : chunk.subarray(0, n)))
      await new Promise((r) => socket.once('drain', r))
  }
  await replied
  return (performance.now() - t0) / 1000
}

/** Bytes/s of `fn` over `numBytes`, median of `repeats` (after one warm-up unless `isWarm`). */
function rate(repeats: number, numBytes: number, fn: () => void, isWarm = true): number {
  if (isWarm) fn()
  const rates: number[] = []
  for (let r = 0; r < repeats; r++) {
    const t0 = performance.now()
    fn()
    rates.push(numBytes / ((performance.now() - t0) / 1000))
  }
  return median(rates)
}

/** Run the benchmark and return its JSON figures. */
export async function benchTransfer(args: string[]): Promise<object> {
  const repeats = flag(args, '--repeats', 7)
  const shape: Shape = {
    numTokens: flag(args, '--tokens', 1000),
    pageSize: flag(args, '--page-size', 16),
    numLayers: flag(args, '--layers', 30),
    numKvHeads: flag(args, '--kv-heads', 3),
    headDim: flag(args, '--head-dim', 64),
    numPages: 0,
  }
  const numPages = Math.ceil(shape.numTokens / shape.pageSize)
  shape.numPages = numPages
  const pool = new KvPool(shape, makeGuards(true))
  for (let layer = 0; layer < shape.numLayers; layer++) {
    for (const t of [pool.k[layer], pool.v[layer]])
      for (let i = 0; i < t.length; i++) t[i] = Math.random()
  }
  const numBytes = numPages * pool.pageBytes

  // 1. Transfer vs raw loopback TCP vs transfer over TLS, alternating so all see the same load.
  const tls = await makeBenchTls()
  const { child, transferPort, tlsTransferPort, sinkPort } = await startChild(shape, tls)
  const senderOptions = {
    host: '127.0.0.1',
    maxPagesPerFrame: flag(args, '--pages-per-frame', 8),
    maxBytesInFlight: flag(args, '--bytes-in-flight', 4 * 1024 * 1024),
    writeBytes: flag(args, '--write-bytes', 256 * 1024),
  }
  const client = new TransferClient({ ...senderOptions, port: transferPort })
  const tlsClient = new TransferClient({
    ...senderOptions,
    port: tlsTransferPort,
    tls: material(tls, 'prefill'),
  })
  const socket = net.connect({ host: '127.0.0.1', port: sinkPort, noDelay: true })
  await new Promise((r) => socket.once('connect', r))
  const chunk = Buffer.alloc(1024 * 1024, 1)
  const transferRates: number[] = []
  const rawRates: number[] = []
  const tlsRates: number[] = []
  const copyRates: number[] = []
  const cpuPerGb = { view: [] as number[], copy: [] as number[] }
  const transferOn = async (path: 'view' | 'copy', rates: number[]) => {
    const t = await timeTransfer(client, pool, shape, path)
    rates.push(numBytes / t.seconds)
    cpuPerGb[path].push(t.cpuSeconds / (numBytes / 1e9))
  }
  try {
    await timeTransfer(client, pool, shape) // warm-up
    await timeRaw(socket, numBytes, chunk)
    await timeTransfer(tlsClient, pool, shape) // warm-up, handshake included
    await timeTransfer(client, pool, shape, 'copy')
    // The four in turn, the order reversed every other repeat (transfer, raw, TLS, copy path;
    // copy path, TLS, raw, transfer): each ratio's two sides are measured beside each other.
    const runs = [
      () => transferOn('view', transferRates),
      async () => rawRates.push(numBytes / (await timeRaw(socket, numBytes, chunk))),
      async () => tlsRates.push(numBytes / (await timeTransfer(tlsClient, pool, shape)).seconds),
      () => transferOn('copy', copyRates),
    ]
    for (let r = 0; r < repeats; r++) {
      for (const run of r % 2 === 0 ? runs : [...runs].reverse()) await run()
    }
  } finally {
    socket.destroy()
    await client.close()
    await tlsClient.close()
    child.disconnect()
  }
  const transferBps = median(transferRates)
  const rawBps = median(rawRates)
  const tlsBps = median(tlsRates)

  // 2. Checksum vs memcpy over the same pages (each page's K and V of every layer, gathered once).
  const pages = Array.from({ length: numPages }, (_, o) => {
    const bytes = new Uint8Array(pool.pageBytes)
    gatherPage(pool, o, bytes)
    return bytes
  })
  // The copy goes to distinct destination pages, as the receiver's scatter into its pool does.
  const copyDst = new Uint8Array(numBytes)
  let sink = 0n
  const checksumPass = () => {
    for (const page of pages) sink = (sink + pageChecksum(page)) & 0xffff_ffff_ffff_ffffn
  }
  const memcpyPass = () => {
    for (let o = 0; o < numPages; o++) copyDst.set(pages[o], o * pool.pageBytes)
  }
  checksumPass() // warm-up
  memcpyPass()
  const hashCopyPairs = interleavedPairsSync(
    repeats,
    () => rate(1, numBytes, checksumPass, false),
    () => rate(1, numBytes, memcpyPass, false),
  )
  // The checksum kind: xxh3 (the same package's) against the xxh64 the wire uses, same pages.
  const xxh3Pass = () => {
    for (const page of pages) sink = (sink + xxh3.xxh64(page)) & 0xffff_ffff_ffff_ffffn
  }
  xxh3Pass()
  const xxh3Pairs = interleavedPairsSync(
    repeats,
    () => rate(1, numBytes, xxh3Pass, false),
    () => rate(1, numBytes, checksumPass, false),
  )
  const checksumBps = median(hashCopyPairs.map((p) => p.numerator))
  const memcpyBps = median(hashCopyPairs.map((p) => p.denominator))

  // 3. Decode with guards on vs off (single-process engine on the bundled model).
  const decodeTokens = flag(args, '--decode-tokens', 300)
  const decodeRepeats = flag(args, '--decode-repeats', 15)
  const model = loadModel(echoModelDir)
  const cores = {
    on: createWorkerCore({
      model,
      numPages: 64,
      pageSize: 16,
      faults: buildFaultConfig([], false, {}),
    }),
    off: createWorkerCore({
      model,
      numPages: 64,
      pageSize: 16,
      faults: buildFaultConfig([], true, { KVFENCE_ALLOW_FAULTS: '1' }),
    }),
  }
  const prompt = [1, ...Array.from({ length: 100 }, (_, i) => 5 + (i % 90))]
  const decodeRate = (core: (typeof cores)['on']): number => {
    const t0 = performance.now()
    const out = generateLocal(core, prompt, {
      maxTokens: decodeTokens,
      sampling: { temperature: 0, topP: 1, seed: null },
      stopTokenIds: [],
    })
    return out.tokenIds.length / ((performance.now() - t0) / 1000)
  }
  decodeRate(cores.on)
  decodeRate(cores.off)
  const onRates: number[] = []
  const offRates: number[] = []
  // Alternating on/off, and which goes first, so that drifting load hits both alike.
  for (let r = 0; r < decodeRepeats; r++) {
    if (r % 2 === 0) {
      onRates.push(decodeRate(cores.on))
      offRates.push(decodeRate(cores.off))
    } else {
      offRates.push(decodeRate(cores.off))
      onRates.push(decodeRate(cores.on))
    }
  }
  const gb = (bps: number) => Number((bps / 1e9).toFixed(3))
  return {
    kv_shape: {
      tokens: shape.numTokens,
      page_size: shape.pageSize,
      layers: shape.numLayers,
      kv_heads: shape.numKvHeads,
      head_dim: shape.headDim,
      pages: numPages,
      page_bytes: pool.pageBytes,
      total_bytes: numBytes,
    },
    repeats,
    transfer_gb_per_s: gb(transferBps),
    loopback_gb_per_s: gb(rawBps),
    ...ratioFields(
      'transfer_vs_loopback_ratio',
      transferRates.map((x, r) => x / rawRates[r]),
    ),
    copy_path_transfer_gb_per_s: gb(median(copyRates)),
    ...ratioFields(
      'view_vs_copy_path_ratio',
      transferRates.map((x, r) => x / copyRates[r]),
    ),
    sender_cpu_s_per_gb_view_path: Number(median(cpuPerGb.view).toFixed(3)),
    sender_cpu_s_per_gb_copy_path: Number(median(cpuPerGb.copy).toFixed(3)),
    tls_transfer_gb_per_s: gb(tlsBps),
    ...ratioFields(
      'tls_vs_plain_transfer_ratio',
      tlsRates.map((x, r) => x / transferRates[r]),
    ),
    checksum_gb_per_s: gb(checksumBps),
    memcpy_gb_per_s: gb(memcpyBps),
    ...ratioFields(
      'checksum_vs_memcpy_ratio',
      pairRatios(hashCopyPairs, (x) => x),
    ),
    checksum_xxh3_gb_per_s: gb(median(xxh3Pairs.map((p) => p.numerator))),
    ...ratioFields(
      'xxh3_vs_xxh64_ratio',
      pairRatios(xxh3Pairs, (x) => x),
    ),
    decode_tokens: decodeTokens,
    decode_repeats: decodeRepeats,
    decode_guards_on_tokens_per_s: Number(median(onRates).toFixed(1)),
    decode_guards_off_tokens_per_s: Number(median(offRates).toFixed(1)),
    ...ratioFields(
      'guard_overhead_ratio',
      onRates.map((x, r) => x / offRates[r]),
    ),
    targets: {
      transfer_vs_loopback_ratio: 0.7,
      tls_vs_plain_transfer_ratio: 0.6,
      checksum_vs_memcpy_ratio: 0.5,
      guard_overhead_ratio: 0.98,
    },
    checksum_sink: sink.toString(16).slice(0, 4), // keeps the checksum loop from being optimised away
  }
}
