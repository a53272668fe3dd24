/** The two tiers of the compiled test suite (`dist/test`), read from each test file's imports so
 *  that no list or naming rule can drift: a test file is a *process* test when its static import
 *  graph (its own imports, the test helpers' and the modules' of src it reaches: relative paths,
 *  and `import()` of a literal path) reaches `node:child_process` or `node:cluster`, the only ways
 *  a Node program starts another OS process; every other test file is a *unit* test, which starts
 *  no process and so opens no real cluster (it may still listen on 127.0.0.1 and run worker
 *  threads). Only `*.test.js` files count: handed a folder, Node 20's `--test` also runs every
 *  helper module under `test/` as a test file, one process each. Used by tests.ts. */
import { existsSync, readdirSync, readFileSync } from 'node:fs'
import { dirname, join, relative, resolve } from 'node:path'

/** The modules through which a Node program starts another OS process. */
const processModules = new Set(['node:child_process', 'child_process', 'node:cluster', 'cluster'])

/** Specifiers of a compiled ES module's static imports, re-exports and `import()` of a literal. */
export function importSpecifiers(js: string): string[] {
  const found: string[] = []
  const pattern = /(?:\bfrom\s*|\bimport\s*\(?\s*)(['"])([^'"\n]+)\1/g
  for (const m of js.matchAll(pattern)) found.push(m[2])
  return found
}

/** Whether the module at `file` (a compiled `.js` path) reaches a process-starting module through
 *  its imports. `memo` caches each visited file's answer across calls. */
export function reachesProcess(file: string, memo = new Map<string, boolean>()): boolean {
  const known = memo.get(file)
  if (known !== undefined) return known
  memo.set(file, false) // an import cycle back to this file adds nothing
  let found = false
  for (const spec of importSpecifiers(readFileSync(file, 'utf8'))) {
    if (processModules.has(spec)) found = true
    else if (spec.startsWith('.')) {
      const target = resolve(dirname(file), spec)
      if (existsSync(target) && reachesProcess(target, memo)) found = true
    }
    if (found) break
  }
  memo.set(file, found)
  return found
}

/** Every `*.test.js` file under `dir`, sorted, as paths relative to `root`. */
export function testFiles(dir: string, root: string): string[] {
  const files: string[] = []
  const walk = (d: string) => {
    for (const e of readdirSync(d, { withFileTypes: true })) {
      const p = join(d, e.name)
      if (e.isDirectory()) walk(p)
      else if (e.name.endsWith('.test.js')) files.push(relative(root, p))
    }
  }
  walk(dir)
  return files.sort()
}

/** The test files of each tier, paths relative to `root` (the package root). */
export function tiers(root: string): { unit: string[]; process: string[] } {
  const memo = new Map<string, boolean>()
  const unit: string[] = []
  const process: string[] = []
  for (const f of testFiles(join(root, 'dist', 'test'), root))
    (reachesProcess(join(root, f), memo) ? process : unit).push(f)
  return { unit, process }
}
