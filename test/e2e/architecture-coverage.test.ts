/** Architecture coverage of the fault matrix (issue 17): for every architecture the engine loads
 *  (each models/test/ checkpoint, the bundled echo model, and every model type config.ts accepts),
 *  every fault of src/engine/faults.ts is injected into an in-process P/D pair over real loopback
 *  TCP driven by the router's hand-off (test/engine/pair.ts's `runRequest`). Guards on, each
 *  request ends clean: the fault's clean error with no token released, or exactly the
 *  single-process engine's greedy tokens for that model; the guards' trip counters and the
 *  transfers' refusal reasons must show exactly the guard that stopped it. A second line of
 *  defence is checked too: with the first guard of a fault off, the next one must refuse.
 *
 *  The matrix is closed: a models/test folder, a supported model type or a fault it has no row or
 *  driver for fails the first two tests, naming it. What each guard refused, per architecture, is the
 *  table of docs/faults.md § "Architecture coverage"; the last test compares it with what was
 *  measured and fails, printing the table to paste, when they differ (it never writes the doc,
 *  unless KVFENCE_UPDATE_DOCS=1 asks it to). */
import assert from 'node:assert/strict'
import { readFileSync, writeFileSync } from 'node:fs'
import { before, describe, it } from 'node:test'
import type { ErrorCode } from '../../src/common/errors.js'
import { implementedFaults } from '../../src/engine/faults.js'
import type { WorkerCore } from '../../src/engine/worker-core.js'
import { guardIds, type GuardId } from '../../src/kv/guards.js'
import type { Model } from '../../src/model/weights.js'
import { makeRequest, runRequest, until, type Outcome, type Pair } from '../engine/pair.js'
import {
  architectures,
  describeConfig,
  faultsDoc,
  generatedSection,
  renderCoverageTable,
  sectionBegin,
  sectionEnd,
  supportedModelTypes,
  testModelFolders,
  type CoverageRow,
} from '../helpers/architectures.js'
import { greedyTokens, startModelPair, type ModelPairOptions } from '../helpers/model-pair.js'

// ---------------------------------------------------------------------------------------------
// The matrix

/** The models/test folders the matrix has rows for. A folder added there fails the first test
 *  until it is named here (its cells then run, and the docs table gains its row). */
const matrixFolders = [
  'llama-attention-bias',
  'llama-gqa-4-1',
  'llama3-rope-bf16',
  'qwen2-bias-f16',
  'smollm2-tied',
]

/** Supported model types with no checkpoint of their own, and the folder whose weights they are
 *  loaded with (config.ts reads Mistral without a sliding window as Llama). */
const borrowedWeights: Record<string, string> = { mistral: 'llama-gqa-4-1' }

/** Faults that act outside the P/D pair path, each with where it acts instead and the test that
 *  covers it there (printed in the docs table). drop-abort ignores a control-plane abort: no model
 *  data is involved, so its architecture coverage is that of the guard behind it. */
const outsidePairPath: Record<string, string> = {
  'drop-abort':
    'acts in the control server (worker-server.ts ignores the router closing the request), which the in-process pair does not use; test/engine/faults-cluster.test.ts › drop-abort',
  'publish-partial':
    "acts in the prefill worker's prefix cache (an aborted prefill's pages published), which the matrix's pairs run without; test/kv/prefix-cache-publish.test.ts",
  'offload-load-as-hit':
    "acts in the prefix cache's offload tier, which the matrix's pairs run without; test/kv/prefix-cache-offload.test.ts",
  'offload-key-without-tenant':
    "acts in the prefix cache's offload tier, which the matrix's pairs run without; test/kv/prefix-cache-offload.test.ts",
  'delay-begin':
    "a timing fault with no effect of its own (it only holds P's BEGIN, so that a client's cut lands before it); paired with drop-abort in test/audit/faults.test.ts › drop-abort",
}

/** 8-token pages keep every prompt a few pages long inside the smallest model's 64 positions. */
const pageSize = 8
const promptLength = 20 // 3 pages, the last one partly filled
const maxTokens = 6
const tenants = ['tenant-a', 'tenant-b']

/** A refusal reason of `kvfence_transfer_failures_total` → the guard whose check it is
 *  (docs/faults.md): the receiver's manifest checks are G4; `stalled` is P keeping its pages
 *  pinned until the transfer timed out instead of freeing them (G7). Reasons that are guard ids
 *  already ("G7") name themselves. */
const reasonGuard: Record<string, GuardId> = {
  checksum_mismatch: 'G4',
  incomplete: 'G4',
  counts_mismatch: 'G4',
  manifest_mismatch: 'G4',
  tokens_mismatch: 'G4',
  stalled: 'G7',
}

/** What one cell must end with. Counts are exact: any guard trip or refusal reason not listed
 *  must be 0. */
interface Expectation {
  /** Every request fails with one of these codes (the hand-off's error, as the router would end
   *  it), having released no token when every guard is on, and at most a prefix of the
   *  single-process tokens when one is off; or 'exact': every request releases exactly the
   *  single-process tokens and succeeds. */
  end: readonly ErrorCode[] | 'exact'
  trips: { p?: Partial<Record<GuardId, number>>; d?: Partial<Record<GuardId, number>> }
  reasons: { p?: Record<string, number>; d?: Record<string, number> }
  /** Asserts the fault really acted (for a cell that ends in exact tokens, where nothing else
   *  would show it), with both pools idle. */
  footprint?: (pair: Pair) => void
  /** P's pinned pages as D emitted each request's first token, when the cell is about what P
   *  holds while D decodes (null: D emitted no token). */
  pinnedOnP?: readonly (number | null)[]
}

/** One cell: a fault (or a fault with the guard that stops it first switched off) on a fresh
 *  pair, `numRequests` requests one after the other, alternating tenants. */
interface Cell {
  name: string
  pair: Partial<ModelPairOptions>
  numRequests: number
  expect: Expectation
}

/** The cells that drive each fault of the pair path. A fault of src/engine/faults.ts in neither
 *  this table nor {@link outsidePairPath} fails the matrix. */
const drivers: Record<string, Cell[]> = {
  'placeholder-forward': [
    {
      // P's pool holds 16 tokens < 20: P must refuse, never send a one-token placeholder.
      name: 'placeholder-forward',
      pair: { prefillPages: 2, prefillFaults: ['placeholder-forward'] },
      numRequests: 1,
      expect: { end: ['context_length_exceeded'], trips: { p: { G3: 1 } }, reasons: {} },
    },
    {
      name: 'placeholder-forward, G3 off',
      pair: { prefillPages: 2, prefillFaults: ['placeholder-forward'], off: ['G3'] },
      numRequests: 1,
      // The placeholder claims the whole prompt but sends page 0 only: D's receiver refuses
      // its END (G4's manifest check) before anything is decoded.
      expect: {
        end: ['transfer_failed'],
        trips: {},
        reasons: { p: { incomplete: 1 }, d: { incomplete: 1 } },
      },
    },
  ],
  'early-release': [
    {
      name: 'early-release',
      pair: { decodeFaults: ['early-release'] },
      numRequests: 1,
      expect: {
        end: ['guard_violation', 'transfer_failed'],
        trips: { d: { G7: 1 } },
        reasons: { p: { refused_by_receiver: 1 }, d: { G7: 1 } },
      },
    },
    {
      name: 'early-release, G7 off',
      pair: { decodeFaults: ['early-release'], off: ['G7'] },
      numRequests: 1,
      expect: {
        end: ['guard_violation', 'transfer_failed'],
        trips: { d: { G5: 1 } },
        reasons: { p: { refused_by_receiver: 1 }, d: { G5: 1 } },
      },
    },
  ],
  'skip-scrub': [
    {
      // The second request gets the first one's unscrubbed pages (reuse is LIFO).
      name: 'skip-scrub',
      pair: { prefillFaults: ['skip-scrub'], decodeFaults: ['skip-scrub'] },
      numRequests: 2,
      expect: {
        end: 'exact',
        trips: {},
        reasons: {},
        footprint: (pair) => {
          for (const core of [pair.p, pair.d])
            assert.ok(core.pool.k[0].some(Number.isFinite), 'freed pages keep their KV')
        },
      },
    },
  ],
  'stale-epoch': [
    {
      name: 'stale-epoch',
      pair: { prefillFaults: ['stale-epoch'], decodeFaults: ['stale-epoch'] },
      numRequests: 2,
      expect: {
        end: 'exact',
        trips: {},
        reasons: {},
        footprint: (pair) => {
          // Two allocations of the same pages, and no epoch ever left 0.
          for (const core of [pair.p, pair.d]) assert.ok(core.pool.epoch.every((e) => e === 0))
        },
      },
    },
  ],
  'corrupt-transfer': [
    {
      name: 'corrupt-transfer',
      pair: { prefillFaults: ['corrupt-transfer'] },
      numRequests: 1,
      expect: {
        end: ['transfer_failed'],
        trips: {},
        reasons: { p: { checksum_mismatch: 1 }, d: { checksum_mismatch: 1 } },
      },
    },
  ],
  'truncate-transfer': [
    {
      name: 'truncate-transfer',
      pair: { prefillFaults: ['truncate-transfer'] },
      numRequests: 1,
      expect: {
        end: ['transfer_failed'],
        trips: {},
        reasons: { p: { incomplete: 1 }, d: { incomplete: 1 } },
      },
    },
    {
      // No manifest check left: D starts decoding over a prompt page it never received (which
      // holds the previous request's KV: skip-scrub); G5 refuses the first write past it, since
      // it would leave that page's positions unwritten. P's first token has left by then.
      name: 'truncate-transfer + skip-scrub, G4 off',
      pair: {
        prefillFaults: ['truncate-transfer', 'skip-scrub'],
        decodeFaults: ['skip-scrub'],
        off: ['G4'],
      },
      numRequests: 2,
      expect: { end: ['guard_violation'], trips: { d: { G5: 2 } }, reasons: {} },
    },
  ],
  'lost-ack': [
    {
      name: 'lost-ack',
      // D has every page and decodes, but P, never ACKed, keeps all 3 prompt pages pinned (G7)
      // until its transfer times out; the hand-off releases nothing P has not confirmed. The
      // timeout leaves D ample time for its first token on a loaded machine.
      pair: { decodeFaults: ['lost-ack'], transferTimeoutMs: 1_000 },
      numRequests: 1,
      expect: {
        end: ['transfer_failed'],
        trips: {},
        reasons: { p: { stalled: 1 } },
        pinnedOnP: [Math.ceil(promptLength / pageSize)],
      },
    },
  ],
}

// ---------------------------------------------------------------------------------------------
// Running a cell

/** `promptLength` token ids spread over the model's vocabulary, avoiding the first 3 ids
 *  (special tokens in the echo model). */
function promptFor(model: Model): number[] {
  const V = model.config.vocabSize
  return Array.from({ length: promptLength }, (_, i) => 3 + ((i * 7) % (V - 3)))
}

/** Non-zero guard trips of a worker, by guard. */
function tripsOf(core: WorkerCore): Partial<Record<GuardId, number>> {
  return Object.fromEntries(Object.entries(core.trips.counts).filter(([, n]) => n > 0))
}

/** Non-zero `kvfence_transfer_failures_total` of a worker, by reason. */
async function reasonsOf(core: WorkerCore): Promise<Record<string, number>> {
  const { values } = await core.metrics.transferFailures.get()
  return Object.fromEntries(
    values.filter((v) => v.value > 0).map((v) => [String(v.labels.reason), v.value]),
  )
}

/** What a cell measured: the guards that refused (from counters and refusal reasons) and
 *  whether it ended in exact tokens. */
interface Measured {
  guards: Set<GuardId>
  isExact: boolean
}

/** Run `cell` on a fresh pair over `model` and assert its expectation; returns what it measured. */
async function runCell(model: Model, cell: Cell, oracle: number[]): Promise<Measured> {
  const pair = await startModelPair(model, {
    pageSize,
    prefillPages: 16,
    decodePages: 16,
    ...cell.pair,
  })
  try {
    const prompt = promptFor(model)
    const outcomes: Outcome[] = []
    const pinnedOnP: (number | null)[] = []
    for (let i = 0; i < cell.numRequests; i++) {
      pinnedOnP.push(null)
      const onToken = (n: number) => {
        if (n === 1) pinnedOnP[i] = pair.p.pool.pins.filter((pins) => pins > 0).length
      }
      const req = makeRequest(tenants[i % 2], prompt, maxTokens)
      outcomes.push(await runRequest(pair, req, { onToken }))
    }
    const isShipped = !cell.pair.off?.length
    for (const [i, out] of outcomes.entries()) assertEnd(cell.expect.end, out, oracle, isShipped, i)
    // Pages are freed once every transfer settled, which may follow the request's end.
    await until(() => pair.p.pool.numUsed === 0 && pair.d.pool.numUsed === 0, 5_000)
    const { expect } = cell
    if (isShipped) {
      // With every guard on, the pools' invariants hold too.
      pair.p.pool.check()
      pair.d.pool.check()
    }
    expect.footprint?.(pair)
    if (expect.pinnedOnP) assert.deepEqual(pinnedOnP, expect.pinnedOnP, "P's pinned pages")
    assert.deepEqual(tripsOf(pair.p), expect.trips.p ?? {}, 'guard trips on P')
    assert.deepEqual(tripsOf(pair.d), expect.trips.d ?? {}, 'guard trips on D')
    const reasons = { p: await reasonsOf(pair.p), d: await reasonsOf(pair.d) }
    assert.deepEqual(reasons.p, expect.reasons.p ?? {}, 'transfer refusal reasons on P')
    assert.deepEqual(reasons.d, expect.reasons.d ?? {}, 'transfer refusal reasons on D')
    const guards = new Set<GuardId>()
    for (const core of [pair.p, pair.d])
      for (const id of Object.keys(tripsOf(core))) guards.add(id as GuardId)
    for (const reason of [...Object.keys(reasons.p), ...Object.keys(reasons.d)]) {
      const guard = (guardIds as readonly string[]).includes(reason)
        ? (reason as GuardId)
        : reasonGuard[reason]
      if (guard !== undefined) guards.add(guard)
    }
    return { guards, isExact: expect.end === 'exact' }
  } finally {
    await pair.close()
  }
}

/** One request ended as `end` says: exactly `oracle`, or its code with no token released
 *  (`isShipped`: every guard on) or only a prefix of `oracle` (a guard off). */
function assertEnd(
  end: Expectation['end'],
  out: Outcome,
  oracle: number[],
  isShipped: boolean,
  i: number,
): void {
  const released = out.released.flatMap((e) => (e.type === 'token' ? [e.tokenId] : []))
  if (end === 'exact') {
    assert.equal(out.error, null, `request ${i}: ${String(out.error)}`)
    assert.deepEqual(released, oracle, `request ${i}: the single-process tokens`)
    return
  }
  assert.ok(out.error, `request ${i}: expected an error, got tokens ${JSON.stringify(released)}`)
  assert.ok(end.includes(out.error.code), `request ${i}: code ${out.error.code} not in ${end}`)
  if (isShipped) assert.deepEqual(released, [], `request ${i}: no token leaves a failed request`)
  else assert.deepEqual(released, oracle.slice(0, released.length), `request ${i}: released`)
}

// ---------------------------------------------------------------------------------------------
// The tests

const modelTypes = supportedModelTypes()
const rows = architectures(matrixFolders, modelTypes, borrowedWeights)
const measured = new Map<string, Map<string, Measured>>() // architecture → cell → measured
const loaded = new Map<string, Model>()
/** `arch`'s model, loaded once per run. */
function modelOf(arch: (typeof rows)[number]): Model {
  let model = loaded.get(arch.name)
  if (model === undefined) loaded.set(arch.name, (model = arch.load()))
  return model
}

describe('the matrix covers every architecture and every fault', () => {
  it('has a row for every models/test folder and every model type config.ts accepts', () => {
    const onDisk = testModelFolders()
    assert.deepEqual(
      onDisk.filter((f) => !matrixFolders.includes(f)),
      [],
      'models/test folders not in the architecture matrix: add them to matrixFolders',
    )
    assert.deepEqual(
      matrixFolders.filter((f) => !onDisk.includes(f)),
      [],
      'matrixFolders names folders models/test no longer has',
    )
    const covered = new Set(rows.map((r) => modelOf(r).config.modelType))
    const missing = modelTypes.filter((t) => !covered.has(t))
    assert.deepEqual(
      missing,
      [],
      `model types without a row: add a models/test/ checkpoint or an entry in borrowedWeights`,
    )
    assert.ok(
      Object.keys(borrowedWeights).every((t) => modelTypes.includes(t)),
      'borrowedWeights names a model type config.ts no longer accepts',
    )
  })

  it('has a driver, or a documented reason to run elsewhere, for every fault', () => {
    const undriven = implementedFaults.filter(
      (f) => !Object.hasOwn(drivers, f) && !Object.hasOwn(outsidePairPath, f),
    )
    assert.deepEqual(
      undriven,
      [],
      'faults the architecture matrix cannot drive: add cells to `drivers`, or to `outsidePairPath` with where they act',
    )
    const stale = [...Object.keys(drivers), ...Object.keys(outsidePairPath)].filter(
      (f) => !(implementedFaults as readonly string[]).includes(f),
    )
    assert.deepEqual(stale, [], 'the matrix names faults src/engine/faults.ts does not have')
  })
})

for (const arch of rows) {
  describe(`${arch.name}: every fault, guards on, ends clean`, () => {
    let model: Model
    let oracle: number[]
    before(() => {
      model = modelOf(arch)
      oracle = greedyTokens(model, promptFor(model), maxTokens, pageSize)
      // Random weights may repeat one token; the comparison is still exact, but never empty.
      assert.equal(oracle.length, maxTokens)
    })
    const cells = implementedFaults.flatMap((f) => drivers[f] ?? [])
    for (const cell of cells) {
      it(cell.name, async () => {
        const result = await runCell(model, cell, oracle)
        if (!measured.has(arch.name)) measured.set(arch.name, new Map())
        measured.get(arch.name)!.set(cell.name, result)
      })
    }
  })
}

describe('docs/faults.md', () => {
  it('§ Architecture coverage is the table this run measured', () => {
    const table = coverageTable()
    const doc = readFileSync(faultsDoc, 'utf8')
    const current = generatedSection(doc)
    if (current === table) return
    if (process.env.KVFENCE_UPDATE_DOCS === '1') {
      const updated =
        current === null
          ? `${doc.trimEnd()}\n\n${sectionBegin}\n${table}${sectionEnd}\n`
          : doc.replace(
              `${sectionBegin}\n${current}${sectionEnd}`,
              () => `${sectionBegin}\n${table}${sectionEnd}`,
            )
      writeFileSync(faultsDoc, updated)
      return
    }
    assert.fail(
      `docs/faults.md's generated section differs from what this run measured; paste this between its markers ` +
        `(or run with KVFENCE_UPDATE_DOCS=1):\n\n${sectionBegin}\n${table}${sectionEnd}\n`,
    )
  })
})

/** The generated section: the architecture × guard table, and what was left out of it. */
function coverageTable(): string {
  const coverage: CoverageRow[] = rows.map((arch) => {
    const cells = measured.get(arch.name)
    assert.ok(cells, `${arch.name} measured nothing (its cells failed)`)
    const refusedBy: Record<string, string[]> = {}
    const exactTokens: string[] = []
    for (const [name, m] of cells) {
      for (const g of m.guards) (refusedBy[g] ??= []).push(name)
      if (m.isExact) exactTokens.push(name)
    }
    return {
      architecture: arch.name,
      describes: describeConfig(modelOf(arch).config),
      refusedBy,
      exactTokens,
    }
  })
  const exercised = guardIds.filter((g) => coverage.some((r) => (r.refusedBy[g] ?? []).length > 0))
  const notExercised = guardIds.filter((g) => !exercised.includes(g))
  const outside = Object.entries(outsidePairPath)
    .map(([f, where]) => `- \`${f}\`: ${where}.`)
    .join('\n')
  return [
    renderCoverageTable(coverage, exercised),
    `No cell of this matrix saw ${notExercised.join(', ')} refuse; the tables above name the tests that do.`,
    '',
    `Faults that act outside the P/D pair path:`,
    '',
    outside,
    '',
  ].join('\n')
}
