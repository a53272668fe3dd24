/** `mkdir -p` that always ends: Node 20's `mkdirSync(path, { recursive: true })` spins forever at
 *  100% CPU on a path under /proc (e.g. `kvfence demo --out /proc/x`), so the missing folders are
 *  made one level at a time, each with a plain `mkdirSync` whose error is thrown as is. */
import { existsSync, mkdirSync } from 'node:fs'
import { dirname, resolve } from 'node:path'

/** Make folder `dir` and any missing parents. Throws the first `mkdirSync` error (ENOENT, EACCES,
 *  EROFS, ENOTDIR, …) naming the folder that could not be made; an existing folder is fine. */
export function makeDir(dir: string): void {
  const missing: string[] = []
  for (let d = resolve(dir); !existsSync(d); d = dirname(d)) {
    missing.push(d)
    if (dirname(d) === d) break // the root itself is missing: let mkdirSync say so
  }
  for (const d of missing.reverse()) {
    try {
      mkdirSync(d)
    } catch (err) {
      // Made meanwhile by another process: fine, as with mkdir -p.
      if ((err as NodeJS.ErrnoException).code !== 'EEXIST') throw err
    }
  }
}
