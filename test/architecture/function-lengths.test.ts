/** No function in the router, the engine, the control plane or the transfer is over {@link maxLines} lines: each
 *  tells one story a reader can hold (STYLE.md 14 allows a long one that does, such as the
 *  forward pass in src/model, which is not measured here). A function's length is counted with
 *  the TypeScript compiler, from the line of its first token (after its doc comment) to the line
 *  of its closing brace, both included; nested functions are measured on their own and also count
 *  inside the one that holds them. */
import assert from 'node:assert/strict'
import { readdirSync, readFileSync } from 'node:fs'
import { join, relative } from 'node:path'
import { describe, it } from 'node:test'
import ts from 'typescript'
import { repoRoot } from '../helpers/paths.js'

/** The longest function allowed, in lines. */
const maxLines = 120

/** Folders of src/ whose functions are measured. */
const measuredFolders = ['router', 'engine', 'control', 'transfer']

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

  it(`no function in src/${measuredFolders.join(', src/')} is over ${maxLines} lines`, () => {
    const tooLong: string[] = []
    for (const folder of measuredFolders) {
      for (const file of sourceFiles(join(repoRoot, 'src', folder))) {
        for (const f of functionLengths(file, readFileSync(file, 'utf8'))) {
          if (f.numLines > maxLines)
            tooLong.push(`${relative(repoRoot, file)}:${f.line} ${f.name}: ${f.numLines} lines`)
        }
      }
    }
    assert.deepEqual(tooLong, [], `functions over ${maxLines} lines:\n${tooLong.join('\n')}`)
  })
})
