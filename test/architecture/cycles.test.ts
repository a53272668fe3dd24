/** No import cycle in src/: every module can be read (and is evaluated) after the modules it
 *  imports, so a newcomer can learn src/ bottom up, and no module ever sees another's exports
 *  still uninitialized at load. Imports are read with the TypeScript compiler (imports.ts, as the
 *  layers test reads them).
 *  Type-only imports (`import type`, names all marked `type`, `import('…')` types) are left out:
 *  they are erased from the JavaScript, so they cannot order evaluation, and two modules naming
 *  each other's types (a request and the handle it returns) describe one contract, not a tangle of
 *  behaviour. */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import { srcImportEdges } from './imports.js'

/** The cycles of a directed graph: its strongly connected components of more than one node, or
 *  one node importing itself, each as one closed path through it (`a → b → a`), sorted. Tarjan's
 *  algorithm (iterative, so a deep graph cannot overflow the stack). */
export function importCycles(edges: readonly (readonly [string, string])[]): string[] {
  const next = new Map<string, string[]>()
  for (const [from, to] of edges) {
    if (!next.has(from)) next.set(from, [])
    if (!next.has(to)) next.set(to, [])
    next.get(from)!.push(to)
  }
  const index = new Map<string, number>()
  const low = new Map<string, number>()
  const onStack = new Set<string>()
  const stack: string[] = []
  const components: string[][] = []
  let counter = 0
  for (const root of [...next.keys()].sort()) {
    if (index.has(root)) continue
    const work: { node: string; i: number }[] = [{ node: root, i: 0 }]
    index.set(root, counter)
    low.set(root, counter++)
    stack.push(root)
    onStack.add(root)
    while (work.length > 0) {
      const top = work[work.length - 1]
      const targets = next.get(top.node)!
      if (top.i < targets.length) {
        const to = targets[top.i++]
        if (!index.has(to)) {
          index.set(to, counter)
          low.set(to, counter++)
          stack.push(to)
          onStack.add(to)
          work.push({ node: to, i: 0 })
        } else if (onStack.has(to)) low.set(top.node, Math.min(low.get(top.node)!, index.get(to)!))
        continue
      }
      work.pop()
      if (work.length > 0) {
        const parent = work[work.length - 1].node
        low.set(parent, Math.min(low.get(parent)!, low.get(top.node)!))
      }
      if (low.get(top.node) !== index.get(top.node)) continue
      const component: string[] = []
      let member: string
      do {
        member = stack.pop()!
        onStack.delete(member)
        component.push(member)
      } while (member !== top.node)
      const isSelfLoop = component.length === 1 && next.get(top.node)!.includes(top.node)
      if (component.length > 1 || isSelfLoop) components.push(component)
    }
  }
  return components.map((c) => closedPath(c, next)).sort()
}

/** One closed path through the first (sorted) node of a strongly connected
 *  component and back, by breadth-first search inside the component: `a → b → a`. */
function closedPath(component: string[], next: Map<string, string[]>): string {
  const members = new Set(component)
  const start = [...component].sort()[0]
  const cameFrom = new Map<string, string>()
  const queue = [start]
  for (let k = 0; k < queue.length; k++) {
    for (const to of next.get(queue[k])!) {
      if (!members.has(to)) continue
      if (to === start) {
        const path = [start]
        for (let at = queue[k]; at !== start; at = cameFrom.get(at)!) path.splice(1, 0, at)
        return [...path, start].join(' → ')
      }
      if (!cameFrom.has(to)) {
        cameFrom.set(to, queue[k])
        queue.push(to)
      }
    }
  }
  throw new Error(`no closed path through ${start}`)
}

describe('import cycles in src/', () => {
  it('finds cycles, and only cycles, in a small graph', () => {
    assert.deepEqual(importCycles([]), [])
    assert.deepEqual(
      importCycles([
        ['a', 'b'],
        ['b', 'c'],
      ]),
      [],
    )
    assert.deepEqual(
      importCycles([
        ['a', 'b'],
        ['b', 'a'],
      ]),
      ['a → b → a'],
    )
    assert.deepEqual(importCycles([['x', 'x']]), ['x → x'])
    // Two cycles, a chain between them, and a diamond (a → b, a → c, b → d, c → d) that is none.
    assert.deepEqual(
      importCycles([
        ['p', 'q'],
        ['q', 'r'],
        ['r', 'p'],
        ['r', 's'],
        ['s', 't'],
        ['t', 's'],
        ['a', 'b'],
        ['a', 'c'],
        ['b', 'd'],
        ['c', 'd'],
      ]),
      ['p → q → r → p', 's → t → s'],
    )
  })

  it('no module in src/ imports, through any chain, itself', () => {
    const edges = srcImportEdges()
      .filter((e) => !e.isTypeOnly)
      .map((e) => [e.from, e.to] as const)
    assert.deepEqual(importCycles(edges), [], 'import cycles in src/ (type-only imports left out)')
  })
})
