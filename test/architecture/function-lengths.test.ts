/** No function in src/ is over {@link maxLines} lines: each tells one story a reader can hold. STYLE.md 14 allows a long
 *  one that does: the one such function is named in {@link exceptions} with its reason. A
 *  function's length is counted with
 *  the TypeScript compiler, from the line of its first token (after its doc comment) to the line
 *  of its closing brace, both included; nested functions are measured on their own and also count
 *  inside the one that holds them. */
import assert from 'node:assert/strict'
import { readdirSync, readFileSync } from 'node:fs'
import { join, relative, sep } from 'node:path'
import { describe, it } from 'node:test'
import ts from 'typescript'
import { repoRoot } from '../helpers/paths.js'

/** The longest function allowed, in lines. */
const maxLines = 120

/** Folders of src/ whose functions are not measured: none now that src/audit (the watch too) is
 *  under the bound; kept so that a folder exempted for a while is named here with its reason. */
const unmeasuredFolders: readonly string[] = []

/** Functions allowed over {@link maxLines}, as `path:name` (path relative to the repository), each
 *  with why it stays one function. */
const exceptions: Readonly<Record<string, string>> = {
  'src/model/forward.ts:forwardBatch':
    'the forward pass, one story read top to bottom beside its shape comments (STYLE.md 14): ' +
    'embedding, then per layer attention and MLP, then the logits; split into steps it would ' +
    'hand a dozen buffers between functions and hide the order of a layer',
}

/** Every function with a body in a source text: its name (or `<anonymous>`), 1-based first line
 *  and length in lines. */
export function functionLengths(
  fileName: string,
  text: string,
): { name: string; line: number; numLines: number }[] {
  const source = ts.createSourceFile(fileName, text, ts.ScriptTarget.Latest, true)
  const lineOf = (pos: number) => source.getLineAndCharacterOfPosition(pos).line
  const found: { name: string; line: number; numLines: number }[] = []
  const visit = (node: ts.Node) => {
    if (ts.isFunctionLike(node) && 'body' in node && node.body !== undefined) {
      const first = lineOf(node.getStart())
      const named = (node as { name?: ts.Node }).name
      const name =
        named?.getText() ??
        (ts.isVariableDeclaration(node.parent) ? node.parent.name.getText() : '<anonymous>')
      found.push({ name, line: first + 1, numLines: lineOf(node.end) - first + 1 })
    }
    ts.forEachChild(node, visit)
  }
  visit(source)
  return found
}

/** Every `.ts` file under `dir`, absolute. */
function sourceFiles(dir: string): string[] {
  return readdirSync(dir, { withFileTypes: true }).flatMap((e) =>
    e.isDirectory()
      ? sourceFiles(join(dir, e.name))
      : e.name.endsWith('.ts')
        ? [join(dir, e.name)]
        : [],
  )
}

describe('function lengths', () => {
  it('counts from the first token to the closing brace, nested functions on their own', () => {
    const text = [
      '/** doc */',
      'export function outer(): number {',
      '  const inner = () => {',
      '    return 1',
      '  }',
      '  return inner()',
      '}',
      'class A {',
      '  m(): void {}',
      '}',
    ].join('\n')
    assert.deepEqual(functionLengths('x.ts', text), [
      { name: 'outer', line: 2, numLines: 6 },
      { name: 'inner', line: 3, numLines: 3 },
      { name: 'm', line: 9, numLines: 1 },
    ])
  })

  it(`no function in src/ (but src/${unmeasuredFolders.join(', src/')}) is over ${maxLines} lines, but the named exceptions`, () => {
    const tooLong: string[] = []
    const longExceptions: string[] = []
    for (const file of sourceFiles(join(repoRoot, 'src'))) {
      const path = relative(repoRoot, file).split(sep).join('/')
      if (unmeasuredFolders.some((folder) => path.startsWith(`src/${folder}/`))) continue
      for (const f of functionLengths(file, readFileSync(file, 'utf8'))) {
        if (f.numLines <= maxLines) continue
        if (`${path}:${f.name}` in exceptions) longExceptions.push(`${path}:${f.name}`)
        else tooLong.push(`${path}:${f.line} ${f.name}: ${f.numLines} lines`)
      }
    }
    assert.deepEqual(tooLong, [], `functions over ${maxLines} lines:\n${tooLong.join('\n')}`)
    // An exception that is no longer long is struck from the list rather than kept in reserve.
    assert.deepEqual(longExceptions.sort(), Object.keys(exceptions).sort())
  })
})
