/** Reading and parsing the YAML files that hold tenants (a tenants file, a cluster config file)
 *  without ever echoing their content. These files hold key digests (and, by an operator's
 *  mistake, perhaps a plain key), and their errors go to logs and terminals: an error names the
 *  file, the position (line, column) and the kind of fault, never the text at that position. The
 *  `yaml` library's own messages are not used for that reason (they carry a code frame of the
 *  offending lines, and some quote tags, aliases or escapes). Reads are bounded: a file that is
 *  not a regular file (a directory, `/dev/zero`, a FIFO) or is larger than
 *  {@link maxYamlFileBytes} is refused before it is read.
 *  Knows files and YAML syntax; knows nothing of what the documents mean. */
import { closeSync, constants, fstatSync, openSync, readSync } from 'node:fs'
import { type Document, type ErrorCode as YamlErrorCode, LineCounter, parseDocument } from 'yaml'
import { type ErrorCode, KvfenceError } from '../common/errors.js'

/** The largest tenants or config file read, bytes (16 MiB: some 80 000 tenants). */
export const maxYamlFileBytes = 16 * 1024 * 1024

/** `yaml` parse error messages known to quote nothing from the file (yaml 2.9's fixed texts, and
 *  those naming only `flow map` / `flow sequence`). Any other message (some quote a tag, an
 *  alias, an escape or a token) is replaced by the kind of its code, {@link yamlFaults}. */
const quotesNothing = new Set([
  'An alias node must not specify any properties',
  'Alias cannot be an empty string',
  'Anchor cannot be an empty string',
  'All mapping items must start at the same column',
  'All sequence items must start at the same column',
  'A block sequence may not be used as an implicit map key',
  'Nested mappings are not allowed in compact mappings',
  'Map keys must be unique',
  'Comments must be separated from other tokens by white space characters',
  'Implicit map keys need to be followed by map values',
  'Missing closing "quote',
  "Missing closing 'quote",
  'Sequence item without - indicator',
  'Tags and anchors must be separated from the next token by white space',
  'Implicit keys need to be on a single line',
  'Implicit keys of flow sequence pairs need to be on a single line',
  'A node can have at most one anchor',
  'A node can have at most one tag',
  'Tabs are not allowed as indentation',
])
const quotesNothingFlow =
  /^(Missing , between|Missing , or : between|Unexpected empty item in|Missing space after : in) flow (map|sequence)( items)?$/

/** The kind of each `yaml` parse error, in words that quote nothing from the file. */
const yamlFaults: Record<YamlErrorCode, string> = {
  ALIAS_PROPS: 'an alias with a tag or anchor',
  BAD_ALIAS: 'a bad alias',
  BAD_DIRECTIVE: 'a bad directive',
  BAD_DQ_ESCAPE: 'a bad escape in a double-quoted string',
  BAD_INDENT: 'bad indentation',
  BAD_PROP_ORDER: 'tag and anchor in the wrong order',
  BAD_SCALAR_START: 'a plain value starting with a reserved character',
  BLOCK_AS_IMPLICIT_KEY: 'a block used as a key',
  BLOCK_IN_FLOW: 'a block inside a flow collection',
  DUPLICATE_KEY: 'a duplicate key',
  IMPOSSIBLE: 'a structure the parser cannot handle',
  KEY_OVER_1024_CHARS: 'a key longer than 1024 characters',
  MISSING_CHAR: 'a missing character (an unclosed bracket or quote?)',
  MULTILINE_IMPLICIT_KEY: 'a key spanning several lines',
  MULTIPLE_ANCHORS: 'several anchors on one node',
  MULTIPLE_DOCS: 'more than one document',
  MULTIPLE_TAGS: 'several tags on one node',
  NON_STRING_KEY: 'a key that is not a string',
  RESOURCE_EXHAUSTION: 'too many alias expansions',
  TAB_AS_INDENT: 'a tab used for indentation',
  TAG_RESOLVE_FAILED: 'an unknown tag',
  UNEXPECTED_TOKEN: 'an unexpected token',
  BAD_COLLECTION_TYPE: 'a collection of the wrong type for its tag',
}

/** The whole text of the file at `path` (UTF-8). `label` names the file in errors (e.g.
 *  `tenants file /etc/kvfence/tenants.yaml`). Throws KvfenceError(`code`) with one line:
 *  "cannot read LABEL: <the system's reason>", "LABEL is a directory, not a file", "LABEL is not
 *  a regular file" or "LABEL is larger than 16 MiB". Opens without blocking, so a FIFO is refused
 *  rather than waited on. */
export function readYamlFileText(path: string, label: string, code: ErrorCode): string {
  let fd: number
  try {
    fd = openSync(path, constants.O_RDONLY | (constants.O_NONBLOCK ?? 0))
  } catch (err) {
    throw new KvfenceError(code, `cannot read ${label}: ${(err as Error).message}`)
  }
  try {
    const stats = fstatSync(fd)
    if (stats.isDirectory()) throw new KvfenceError(code, `${label} is a directory, not a file`)
    if (!stats.isFile()) throw new KvfenceError(code, `${label} is not a regular file`)
    const tooLarge = () =>
      new KvfenceError(code, `${label} is larger than ${maxYamlFileBytes / 1024 / 1024} MiB`)
    if (stats.size > maxYamlFileBytes) throw tooLarge()
    // Read to the end rather than `size` bytes (the file may change meanwhile), but never past
    // the cap.
    const chunks: Buffer[] = []
    let total = 0
    for (;;) {
      const chunk = Buffer.allocUnsafe(Math.max(64 * 1024, stats.size + 1 - total))
      let n: number
      try {
        n = readSync(fd, chunk, 0, chunk.length, null)
      } catch (err) {
        throw new KvfenceError(code, `cannot read ${label}: ${(err as Error).message}`)
      }
      if (n === 0) break
      total += n
      if (total > maxYamlFileBytes) throw tooLarge()
      chunks.push(chunk.subarray(0, n))
    }
    return Buffer.concat(chunks, total).toString('utf8')
  } finally {
    closeSync(fd)
  }
}

/** `text` parsed as one YAML document (comments and layout kept, for editing). Throws
 *  KvfenceError(`code`) "LABEL is not valid YAML: line L, column C: <kind of fault>" for the
 *  first error (the library's message when it is one known to quote nothing, else the kind of
 *  fault); the message never holds text from the file. */
export function parseYamlDocument(text: string, label: string, code: ErrorCode): Document {
  const lineCounter = new LineCounter()
  const doc = parseDocument(text, { prettyErrors: false, lineCounter })
  const first = doc.errors[0]
  if (first !== undefined) {
    const fault =
      quotesNothing.has(first.message) || quotesNothingFlow.test(first.message)
        ? first.message
        : (yamlFaults[first.code] ?? 'a syntax error')
    const where =
      first.pos[0] >= 0
        ? (({ line, col }) => `line ${line}, column ${col}: `)(lineCounter.linePos(first.pos[0]))
        : ''
    throw new KvfenceError(code, `${label} is not valid YAML: ${where}${fault}`)
  }
  return doc
}

/** `text` parsed as one YAML document into plain values (as `yaml`'s `parse`, without its
 *  warnings on stderr). Throws as {@link parseYamlDocument}, and for an alias that names no
 *  anchor or is expanded too often. */
export function parseYamlText(text: string, label: string, code: ErrorCode): unknown {
  const doc = parseYamlDocument(text, label, code)
  try {
    return doc.toJS()
  } catch (err) {
    // The library's messages here name the alias: its name is file content. It throws a
    // ReferenceError for both faults; only the one for expansions says "Excessive alias count".
    const fault =
      err instanceof ReferenceError && !/excessive alias count/i.test(err.message)
        ? 'an alias (*name) with no anchor (&name) before it'
        : 'too many alias expansions'
    throw new KvfenceError(code, `${label} is not valid YAML: ${fault}`)
  }
}

/** Reads and parses the YAML file at `path` into plain values: {@link readYamlFileText} then
 *  {@link parseYamlText}, with their errors. */
export function loadYamlFile(path: string, label: string, code: ErrorCode): unknown {
  return parseYamlText(readYamlFileText(path, label, code), label, code)
}
