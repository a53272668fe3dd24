/** Temporary folders for tests that are removed when the test process exits, so that helpers
 *  handing a folder to many tests (tenants files, tokenizers, Redis) leave nothing in /tmp (a
 *  day's runs had left over 100). */
import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'

const dirs: string[] = []
process.once('exit', () => {
  for (const dir of dirs) rmSync(dir, { recursive: true, force: true })
})

/** A fresh folder under the system's temporary folder, named `prefix` + 6 random characters,
 *  removed (with what it holds) when this process exits. */
export function tempDir(prefix: string): string {
  const dir = mkdtempSync(join(tmpdir(), prefix))
  dirs.push(dir)
  return dir
}
