/** Turns a stream of generated token ids into a stream of text: incremental detokenization and
 *  the request's stop strings (which end the output and are not part of it).
 *  Knows token ids, text and a decode function; knows nothing of HTTP or workers. */
import assert from 'node:assert/strict'

/** Decodes token ids to text (special tokens skipped). */
export type DecodeFn = (ids: readonly number[]) => string

/** What one step produced. */
export interface TextStep {
  /** New text safe to send to the client (may be empty). */
  text: string
  /** A stop string matched: the output ends here, `text` is its last piece. */
  isStopped: boolean
}

/** Largest number of stop strings accepted (OpenAI's limit). */
export const maxStopStrings = 4

/** Incremental text of generated tokens. A token whose text is incomplete on its own (part of a
 *  multi-byte character) is held back until the characters complete; a suffix of the text that
 *  begins a stop string is held back until it can no longer become one, so that no part of a
 *  stop string is ever sent. */
export class TextStream {
  private readonly ids: number[] = []
  /** Text before this offset was already decoded into `text` … */
  private prefixOffset = 0
  /** … and ids[prefixOffset, readOffset) are kept as left context for the next token. */
  private readOffset = 0
  /** All text decoded so far (stop strings not yet removed). */
  private text = ''
  /** Characters of `text` sent so far. */
  private numSent = 0
  private isDone = false
  private readonly stops: readonly string[]
  private readonly holdBack: number

  constructor(
    private readonly decode: DecodeFn,
    stops: readonly string[],
  ) {
    this.stops = stops.filter((s) => s.length > 0)
    this.holdBack = Math.max(0, ...this.stops.map((s) => s.length - 1))
  }

  /** Asserts the invariants: offsets in order, nothing sent beyond the decoded text. */
  check(): void {
    assert.ok(
      this.prefixOffset <= this.readOffset && this.readOffset <= this.ids.length,
      `offsets out of order: ${this.prefixOffset} ≤ ${this.readOffset} ≤ ${this.ids.length}`,
    )
    assert.ok(this.numSent <= this.text.length, `sent ${this.numSent} of ${this.text.length} chars`)
  }

  /** Number of tokens pushed so far. */
  get numTokens(): number {
    return this.ids.length
  }

  /** Adds one generated token. After a stop (`isStopped`), further pushes are refused. */
  push(tokenId: number): TextStep {
    if (this.isDone) throw new Error('TextStream: push after the output ended')
    this.ids.push(tokenId)
    const prefixText = this.decode(this.ids.slice(this.prefixOffset, this.readOffset))
    const newText = this.decode(this.ids.slice(this.prefixOffset))
    if (newText.length > prefixText.length && !newText.endsWith('\uFFFD')) {
      this.text += newText.slice(prefixText.length)
      this.prefixOffset = this.readOffset
      this.readOffset = this.ids.length
    }
    return this.release(false)
  }

  /** Ends the output (the worker finished): returns everything still held back. */
  finish(): TextStep {
    if (this.isDone) return { text: '', isStopped: false }
    const prefixText = this.decode(this.ids.slice(this.prefixOffset, this.readOffset))
    const newText = this.decode(this.ids.slice(this.prefixOffset))
    if (newText.length > prefixText.length) this.text += newText.slice(prefixText.length)
    this.prefixOffset = this.readOffset = this.ids.length
    return this.release(true)
  }

  private release(isFinal: boolean): TextStep {
    // A stop string cannot start before this: earlier text was already searched.
    const searchFrom = Math.max(0, this.numSent - this.holdBack)
    let stopAt = -1
    for (const stop of this.stops) {
      const at = this.text.indexOf(stop, searchFrom)
      if (at !== -1 && (stopAt === -1 || at < stopAt)) stopAt = at
    }
    if (stopAt !== -1) {
      const text = this.text.slice(this.numSent, Math.max(stopAt, this.numSent))
      this.numSent = Math.max(stopAt, this.numSent)
      this.isDone = true
      return { text, isStopped: true }
    }
    const end = isFinal ? this.text.length : this.text.length - this.partialStopLength()
    const text = this.text.slice(this.numSent, end)
    this.numSent = end
    if (isFinal) this.isDone = true
    return { text, isStopped: false }
  }

  /** Length of the longest unsent suffix of the text that is a proper prefix of a stop string. */
  private partialStopLength(): number {
    const maxLength = Math.min(this.holdBack, this.text.length - this.numSent)
    for (let length = maxLength; length > 0; length--) {
      const suffix = this.text.slice(this.text.length - length)
      if (this.stops.some((stop) => stop.startsWith(suffix))) return length
    }
    return 0
  }
}
