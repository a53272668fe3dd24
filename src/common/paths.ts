/** Where the package's own files are, found from this module's location (works from `dist/src/common`). */
import { dirname, join, resolve } from 'node:path'
import { fileURLToPath } from 'node:url'

/** The package root: the folder holding package.json and models/. */
export const packageRoot = resolve(dirname(fileURLToPath(import.meta.url)), '..', '..', '..')
/** The bundled tiny echo model (the embedded default). */
export const bundledModelDir = join(packageRoot, 'models', 'echo-tiny')
/** The compiled CLI entry point, for starting parts of a cluster as child processes. */
export const cliEntry = join(packageRoot, 'dist', 'src', 'cli', 'main.js')
