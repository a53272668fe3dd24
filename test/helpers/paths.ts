/** Paths shared by tests: the repository root and the bundled model, found from this file. */
import { dirname, join, resolve } from 'node:path'
import { fileURLToPath } from 'node:url'

/** Repository root (tests run from `dist/test/...`). */
export const repoRoot = resolve(dirname(fileURLToPath(import.meta.url)), '../../..')
/** The bundled tiny echo model. */
export const echoModelDir = join(repoRoot, 'models', 'echo-tiny')
/** The CLI entry point, compiled. */
export const cliPath = join(repoRoot, 'dist', 'src', 'cli', 'main.js')
