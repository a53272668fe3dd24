/** The import graph of src/, read from the sources with the TypeScript compiler, for the
 *  architecture tests (layers.test.ts, cycles.test.ts). Not a test file itself. */
import { readdirSync, readFileSync } from 'node:fs'
import { dirname, join, relative, resolve, sep } from 'node:path'
import ts from 'typescript'
import { repoRoot } from '../helpers/paths.js'

/** The source folder, absolute. */
export const srcDir = join(repoRoot, 'src')

/** One relative import of a source file: the module path as written, its 1-based line, and
 *  whether it is erased from the JavaScript (`import type`, `export type`, an import whose every
 *  name is marked `type`, or an `import('…')` type). */
export interface SourceImport {
  readonly specifier: string
  readonly line: number
  readonly isTypeOnly: boolean
}

/** Whether every name an import or export declaration binds is type-only. */
function isErased(node: ts.ImportDeclaration | ts.ExportDeclaration): boolean {
  if (ts.isExportDeclaration(node)) {
    if (node.isTypeOnly) return true
    const clause = node.exportClause
    return clause !== undefined && ts.isNamedExports(clause)
      ? clause.elements.length > 0 && clause.elements.every((e) => e.isTypeOnly)
      : false
  }
  const clause = node.importClause
  if (clause === undefined) return false // `import './x.js'`: run for its effects
  if (clause.isTypeOnly) return true
  if (clause.name !== undefined) return false
  const bindings = clause.namedBindings
  return bindings !== undefined && ts.isNamedImports(bindings)
    ? bindings.elements.length > 0 && bindings.elements.every((e) => e.isTypeOnly)
    : false
}

/** Relative module paths a source text imports or re-exports (`import`, `export … from`,
 *  `import()` and `import('…')` types), with their lines. */
export function importsOf(fileName: string, text: string): SourceImport[] {
  const source = ts.createSourceFile(fileName, text, ts.ScriptTarget.Latest, true)
  const found: SourceImport[] = []
  const add = (node: ts.Node, literal: ts.Expression | undefined, isTypeOnly: boolean) => {
    if (literal === undefined || !ts.isStringLiteral(literal)) return
    if (!literal.text.startsWith('.')) return
    const line = source.getLineAndCharacterOfPosition(node.getStart()).line + 1
    found.push({ specifier: literal.text, line, isTypeOnly })
  }
  const visit = (node: ts.Node) => {
    if (ts.isImportDeclaration(node) || ts.isExportDeclaration(node))
      add(node, node.moduleSpecifier, isErased(node))
    else if (ts.isCallExpression(node) && node.expression.kind === ts.SyntaxKind.ImportKeyword)
      add(node, node.arguments[0], false)
    else if (ts.isImportTypeNode(node) && ts.isLiteralTypeNode(node.argument))
      add(node, node.argument.literal as ts.Expression, true)
    ts.forEachChild(node, visit)
  }
  visit(source)
  return found
}

/** Every `.ts` file under `dir`, absolute. */
export function sourceFiles(dir: string): string[] {
  return readdirSync(dir, { withFileTypes: true }).flatMap((e) =>
    e.isDirectory()
      ? sourceFiles(join(dir, e.name))
      : e.name.endsWith('.ts')
        ? [join(dir, e.name)]
        : [],
  )
}

/** A path relative to src/ with `/` separators. */
export function srcRelative(path: string): string {
  return relative(srcDir, path).split(sep).join('/')
}

/** One edge of src/'s import graph: both ends relative to src/ (`.ts`), with the import's line. */
export interface ImportEdge {
  readonly from: string
  readonly to: string
  readonly line: number
  readonly specifier: string
  readonly isTypeOnly: boolean
}

/** Every relative import in src/, as edges between files. */
export function srcImportEdges(): ImportEdge[] {
  return sourceFiles(srcDir).flatMap((file) =>
    importsOf(file, readFileSync(file, 'utf8')).map(({ specifier, line, isTypeOnly }) => ({
      from: srcRelative(file),
      to: srcRelative(resolve(dirname(file), specifier).replace(/\.js$/, '.ts')),
      line,
      specifier,
      isTypeOnly,
    })),
  )
}
