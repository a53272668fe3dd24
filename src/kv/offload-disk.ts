/** Disk tier of the prefix cache's offload: one file per offloaded page in a directory only this
 *  process's user can enter, bounded by bytes (the files' sizes added up).
 *
 *  A file holds a header (the page's key, tenant, model/layout identity, token count, the xxh64
 *  recorded when the page left the KV pool, payload length) and the payload. It is written under a
 *  temporary name (created exclusively, mode 0600) and renamed into place, so a reader finds either
 *  no file or a whole one; what the file says is still verified on every load ({@link OffloadDisk.load}
 *  checks framing and checksum, the caller's {@link verifyOffloaded} key, tenant, layout and token
 *  count), so a file that was torn, truncated, corrupted, copied under another name or written for
 *  another tenant is a failed load, a miss. The file name is SHA-256 of the key, so it says nothing
 *  a guessed key could not.
 *
 *  The directory must exist, be owned by this user with no group or other access (0700), and be
 *  writable; {@link OffloadDisk.open} says which of these fails. Entries found there at start are
 *  deleted: keys are chained from a salt secret drawn per process, so no lookup of this process can
 *  name them, and a changed model or page layout would be refused anyway (cleared on model change).
 *  One directory per prefill worker.
 *
 *  I/O is synchronous: a lookup runs on the prefill path, which is itself synchronous compute, and
 *  a page is tens of kilobytes. No fsync: entries do not outlive the process (see above), and a
 *  crash's torn file fails its checksum.
 *
 *  Knows files, keys, tenant names and bytes; knows nothing of pools, models or transfers. */
import assert from 'node:assert/strict'
import { createHash, randomBytes } from 'node:crypto'
import {
  closeSync,
  openSync,
  readdirSync,
  readFileSync,
  renameSync,
  statSync,
  unlinkSync,
  writeSync,
} from 'node:fs'
import { join } from 'node:path'
import { xxh64 } from '@node-rs/xxhash'
import {
  tenantBytesOf,
  type OffloadedPage,
  type OffloadLoad,
  type OffloadTier,
  type TenantBytes,
} from './offload.js'

/** Options of {@link OffloadDisk.open}. */
export interface OffloadDiskOptions {
  /** The directory (must exist: mode 0700, owned by this user, writable). */
  dir: string
  /** Most file bytes the tier holds (an integer > 0). */
  bytes: number
  /** Most file bytes of one tenant: the same for all, or each tenant's own (read at each store);
   *  unset: `bytes` shared by all tenants. */
  bytesPerTenant?: TenantBytes
}

/** First bytes of every entry file (format version 1). */
const magic = Buffer.from('KVFOFF01', 'latin1')
/** Magic, then the header's length (u32 LE). */
const prefixBytes = magic.length + 4
/** An entry file's name: SHA-256 hex of its key, `.kv`; temporary files add `.tmp-<hex>`. */
const entryName = /^[0-9a-f]{64}\.kv(\.tmp-[0-9a-f]+)?$/

/** Header of an entry file. The checksum is a decimal string (JSON has no 64-bit integers). */
interface Header {
  key: string
  tenant: string
  layout: string
  numTokens: number
  checksum: string
  payloadBytes: number
}

interface Indexed {
  readonly tenant: string
  readonly size: number
}

/** The disk tier of one prefix cache. */
export class OffloadDisk implements OffloadTier {
  /** Entries by key; Map order is age (oldest first). */
  private readonly entries = new Map<string, Indexed>()
  private readonly numBytesOf = new Map<string, number>()
  private numBytesHeld = 0

  private constructor(private readonly options: OffloadDiskOptions) {}

  /** Check `options` and the directory, delete entry files left there, and return the tier.
   *  Throws RangeError for `bytes` (or `bytesPerTenant`, a figure) not an integer > 0, and Error (one line
   *  naming the directory) when the directory is missing, not a directory, not owned by this
   *  user, open to group or others, or not writable. */
  static open(options: OffloadDiskOptions): OffloadDisk {
    const { dir, bytes, bytesPerTenant } = options
    for (const [name, value] of [
      ['bytes', bytes],
      ['bytesPerTenant', typeof bytesPerTenant === 'function' ? undefined : bytesPerTenant],
    ] as const) {
      if (value !== undefined && (!Number.isInteger(value) || value <= 0))
        throw new RangeError(`offload disk ${name} must be an integer > 0, got ${value}`)
    }
    checkDir(dir)
    for (const name of readdirSync(dir)) if (entryName.test(name)) unlinkSync(join(dir, name))
    return new OffloadDisk(options)
  }

  get numPages(): number {
    return this.entries.size
  }

  get numBytes(): number {
    return this.numBytesHeld
  }

  /** Write `payload` to its file (replacing an entry of that key), dropping the oldest entries
   *  (the tenant's own, with `bytesPerTenant`) until it fits. Returns false, holding nothing for
   *  the key, when the file can never fit or could not be written (ENOSPC, EIO, …). */
  store(
    page: Omit<OffloadedPage, 'checksum' | 'payload'>,
    payload: Uint8Array,
    checksum: bigint = xxh64(payload),
  ): boolean {
    const header: Header = {
      key: page.key,
      tenant: page.tenant,
      layout: page.layout,
      numTokens: page.numTokens,
      checksum: checksum.toString(),
      payloadBytes: payload.byteLength,
    }
    const head = Buffer.from(JSON.stringify(header), 'utf8')
    const size = prefixBytes + head.length + payload.byteLength
    this.delete(page.key)
    const { bytes } = this.options
    const bytesPerTenant = tenantBytesOf(this.options.bytesPerTenant, page.tenant)
    if (size > bytes || (bytesPerTenant !== undefined && size > bytesPerTenant)) return false
    if (bytesPerTenant !== undefined) {
      while ((this.numBytesOf.get(page.tenant) ?? 0) + size > bytesPerTenant)
        this.dropOldest(page.tenant)
    }
    while (this.numBytesHeld + size > bytes) this.dropOldest(undefined)
    const length = Buffer.alloc(4)
    length.writeUInt32LE(head.length)
    if (!this.writeAtomically(page.key, [magic, length, head, payload])) return false
    this.entries.set(page.key, { tenant: page.tenant, size })
    this.numBytesHeld += size
    this.numBytesOf.set(page.tenant, (this.numBytesOf.get(page.tenant) ?? 0) + size)
    return true
  }

  /** Read the entry under `key` back: failed (no page) when the file cannot be read or its framing
   *  is wrong, failed (with the page) when its payload does not match the recorded checksum. The
   *  entry stays until {@link delete}. */
  load(key: string): OffloadLoad {
    if (!this.entries.has(key)) return { kind: 'absent' }
    let file: Buffer
    try {
      file = readFileSync(this.pathOf(key))
    } catch (err) {
      return { kind: 'failed', tier: 'disk', reason: (err as Error).message }
    }
    const page = parseEntry(file)
    if (typeof page === 'string') return { kind: 'failed', tier: 'disk', reason: page }
    const checksum = xxh64(page.payload)
    if (checksum !== page.checksum)
      return {
        kind: 'failed',
        tier: 'disk',
        reason: `checksum ${checksum}, stored ${page.checksum}`,
        page,
      }
    return { kind: 'loaded', tier: 'disk', page }
  }

  /** Delete the entry under `key` and its file, if any. */
  delete(key: string): void {
    const entry = this.entries.get(key)
    if (entry === undefined) return
    this.entries.delete(key)
    this.numBytesHeld -= entry.size
    this.numBytesOf.set(entry.tenant, this.numBytesOf.get(entry.tenant)! - entry.size)
    try {
      unlinkSync(this.pathOf(key))
    } catch (err) {
      // Already gone (someone removed it): the entry is gone either way.
      if ((err as NodeJS.ErrnoException).code !== 'ENOENT') throw err
    }
  }

  /** The file an entry of `key` lives in (for tests that damage it, and for {@link load}). */
  pathOf(key: string): string {
    return join(this.options.dir, `${createHash('sha256').update(key).digest('hex')}.kv`)
  }

  /** The tier's invariant: byte counts add up, per tenant and in all, within their bounds (a
   *  tenant whose share shrank may hold more until its own next store trims it), and
   *  the directory holds exactly the indexed entries' files, each of its recorded size, mode 0600. */
  check(): void {
    const perTenant = new Map<string, number>()
    let total = 0
    const files = new Set<string>()
    for (const [key, e] of this.entries) {
      total += e.size
      perTenant.set(e.tenant, (perTenant.get(e.tenant) ?? 0) + e.size)
      const path = this.pathOf(key)
      files.add(path)
      const st = statSync(path)
      assert.equal(st.size, e.size, `offload file ${path}: ${st.size} bytes`)
      assert.equal(st.mode & 0o777, 0o600, `offload file ${path}: mode ${modeOf(st.mode)}`)
    }
    const onDisk = readdirSync(this.options.dir).filter((n) => entryName.test(n))
    assert.deepEqual(
      onDisk.map((n) => join(this.options.dir, n)).sort(),
      [...files].sort(),
      'offload dir holds other entry files than the index',
    )
    assert.equal(total, this.numBytesHeld, `offload disk counts ${this.numBytesHeld} bytes`)
    assert(total <= this.options.bytes, `offload disk holds ${total} bytes`)
    for (const [tenant, n] of this.numBytesOf) {
      assert.equal(perTenant.get(tenant) ?? 0, n, `offload disk: tenant ${tenant} bytes`)
      const bound = this.options.bytesPerTenant
      if (typeof bound === 'number')
        assert(n <= bound, `offload disk: tenant ${tenant} over its bytes`)
    }
  }

  /** Write `parts` to a fresh temporary file (exclusive create, 0600) and rename it over the
   *  entry's file. Returns false (the temporary file removed) when any step fails. */
  private writeAtomically(key: string, parts: readonly Uint8Array[]): boolean {
    const path = this.pathOf(key)
    const tmp = `${path}.tmp-${randomBytes(6).toString('hex')}`
    let fd: number | undefined
    try {
      fd = openSync(tmp, 'wx', 0o600)
      for (const part of parts) {
        for (let at = 0; at < part.byteLength;) at += writeSync(fd, part, at, part.byteLength - at)
      }
      closeSync(fd)
      fd = undefined
      renameSync(tmp, path)
      return true
    } catch {
      if (fd !== undefined) closeSync(fd)
      try {
        unlinkSync(tmp)
      } catch {
        // Never made, or already gone.
      }
      return false
    }
  }

  /** Drop the oldest entry (of `tenant`, when given). */
  private dropOldest(tenant: string | undefined): void {
    for (const [key, e] of this.entries) {
      if (tenant !== undefined && e.tenant !== tenant) continue
      this.delete(key)
      return
    }
    assert.fail('offload disk: nothing to drop')
  }
}

/** `file` as a page, or why it is not one (bad magic, lengths, header fields). */
function parseEntry(file: Buffer): OffloadedPage | string {
  if (file.length < prefixBytes || !file.subarray(0, magic.length).equals(magic))
    return 'not an offload entry (magic)'
  const headBytes = file.readUInt32LE(magic.length)
  if (prefixBytes + headBytes > file.length) return 'header runs past the end of the file'
  let h: Partial<Header>
  try {
    h = JSON.parse(file.subarray(prefixBytes, prefixBytes + headBytes).toString('utf8')) as Header
  } catch {
    return 'header is not JSON'
  }
  const isText = (v: unknown) => typeof v === 'string'
  if (
    !isText(h.key) ||
    !isText(h.tenant) ||
    !isText(h.layout) ||
    !Number.isInteger(h.numTokens) ||
    !/^\d{1,20}$/.test(String(h.checksum)) ||
    !Number.isInteger(h.payloadBytes)
  )
    return 'header fields missing or of the wrong type'
  const payload = file.subarray(prefixBytes + headBytes)
  if (payload.length !== h.payloadBytes)
    return `payload of ${payload.length} bytes, header says ${h.payloadBytes}`
  return {
    key: h.key!,
    tenant: h.tenant!,
    layout: h.layout!,
    numTokens: h.numTokens!,
    checksum: BigInt(h.checksum!),
    payload: new Uint8Array(payload),
  }
}

/** Throw one line naming `dir` when it is not a directory of this user's, closed to group and
 *  others, and writable. */
function checkDir(dir: string): void {
  let st
  try {
    st = statSync(dir)
  } catch (err) {
    const code = (err as NodeJS.ErrnoException).code
    throw new Error(
      code === 'ENOENT'
        ? `offload dir ${dir} does not exist (make it with mode 0700)`
        : `offload dir ${dir}: ${(err as Error).message}`,
    )
  }
  if (!st.isDirectory()) throw new Error(`offload dir ${dir} is not a directory`)
  const uid = process.getuid?.()
  if (uid !== undefined && st.uid !== uid)
    throw new Error(`offload dir ${dir} is owned by uid ${st.uid}, not this process's ${uid}`)
  if ((st.mode & 0o077) !== 0)
    throw new Error(
      `offload dir ${dir} is mode ${modeOf(st.mode)}: it holds tenants' KV, so it must be 0700 (chmod 700 ${dir})`,
    )
  // A real write: access() says yes to root on a read-only file system.
  const probe = join(dir, `.kvfence-probe-${randomBytes(6).toString('hex')}`)
  try {
    closeSync(openSync(probe, 'wx', 0o600))
    unlinkSync(probe)
  } catch (err) {
    throw new Error(`offload dir ${dir} is not writable: ${(err as Error).message}`)
  }
}

function modeOf(mode: number): string {
  return `0${(mode & 0o777).toString(8)}`
}
