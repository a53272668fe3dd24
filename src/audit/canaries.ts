/** Canaries: unique high-entropy strings a tenant plants in its prompts, and the detector that
 *  looks for them (or any fragment of at least `minFragmentLength` characters) in another
 *  tenant's output. Also the redaction that keeps an observer's output out of reports (on a
 *  production endpoint a leaked output may hold real customers' data) while still showing the
 *  auditor's own planted material.
 *  Knows nothing of HTTP or tenants. */
import type { Rng } from './rng.js'

/** A fragment this long or longer counts as a match; random alphanumerics of this length do not
 *  appear by chance (62^8 ≈ 2·10^14). */
export const minFragmentLength = 8
export const redactionMark = '·'

const upper = 'ABCDEFGHIJKLMNOPQRSTUVWXYZ'
const lower = 'abcdefghijklmnopqrstuvwxyz'
const digits = '0123456789'
const alphanumeric = upper + lower + digits

/** Plain lowercase words of at most 7 letters, so filler can never contain an 8-character
 *  alphanumeric run that a canary fragment could match. */
const fillerWords = [
  'the',
  'river',
  'stone',
  'light',
  'water',
  'green',
  'paper',
  'house',
  'small',
  'table',
  'music',
  'bread',
  'cloud',
  'field',
  'happy',
  'north',
  'garden',
  'window',
  'summer',
  'yellow',
  'market',
  'silver',
  'bridge',
  'forest',
  'winter',
  'orange',
  'letter',
  'simple',
  'morning',
  'quiet',
  'and',
  'with',
  'from',
  'over',
  'under',
  'near',
  'after',
  'before',
  'into',
  'about',
  'walks',
  'reads',
  'makes',
  'finds',
  'holds',
  'opens',
  'builds',
  'writes',
  'keeps',
  'sings',
]

/** A canary: 16–24 characters from [A-Za-z0-9], with at least two digits, one capital and one
 *  lowercase letter (so no tokenizer or model mistakes it for a word). */
export function makeCanary(rng: Rng): string {
  for (;;) {
    const length = rng.int(16, 24)
    let canary = ''
    for (let i = 0; i < length; i++) canary += rng.pick([...alphanumeric])
    const numDigits = [...canary].filter((c) => digits.includes(c)).length
    if (numDigits >= 2 && /[A-Z]/.test(canary) && /[a-z]/.test(canary)) return canary
  }
}

/** `count` canaries sharing no fragment of `minFragmentLength` with each other or with `taken`. */
export function makeCanaries(rng: Rng, count: number, taken: readonly string[] = []): string[] {
  const out: string[] = []
  while (out.length < count) {
    const canary = makeCanary(rng)
    const others = [...taken, ...out]
    if (others.every((other) => findFragment(other, canary) === null)) out.push(canary)
  }
  return out
}

/** Planting material: canaries, and a ~200–330-character prompt made of nothing but them.
 *  The whole prompt is high-entropy (issue: "whole prompts, not one marker"): whatever stretch of it
 *  a leaking engine regurgitates to another tenant is a canary fragment, so a leak cannot hide in
 *  copied filler. None shares a fragment with `taken`. */
export function plantingMaterial(
  rng: Rng,
  taken: readonly string[] = [],
): { canaries: string[]; prompt: string } {
  const targetChars = rng.int(200, 330)
  const canaries: string[] = []
  let numChars = 0
  while (numChars < targetChars) {
    const [canary] = makeCanaries(rng, 1, [...taken, ...canaries])
    canaries.push(canary)
    numChars += canary.length + 1
  }
  return { canaries, prompt: canaries.join(' ') }
}

/** A prompt of ~200–350 characters of filler words with the canaries at random places (used where
 *  a prompt must look like ordinary text around a marker, e.g. prefix timing). */
export function plantingPrompt(rng: Rng, canaries: readonly string[]): string {
  const targetChars = rng.int(200, 330)
  const words: string[] = []
  let numChars = canaries.reduce((s, c) => s + c.length + 1, 0)
  while (numChars < targetChars) {
    const word = rng.pick(fillerWords)
    words.push(word)
    numChars += word.length + 1
  }
  for (const canary of canaries) words.splice(rng.int(0, words.length), 0, canary)
  return words.join(' ')
}

export interface CanaryMatch {
  readonly canary: string
  /** The longest fragment of the canary found in the text (≥ minFragmentLength). */
  readonly fragment: string
  /** Where the fragment starts in the text. */
  readonly index: number
}

/** Longest fragment (≥ `minLength` characters) of `canary` that occurs in `text`, or null. */
export function findFragment(
  text: string,
  canary: string,
  minLength: number = minFragmentLength,
): CanaryMatch | null {
  // Every fragment of `minLength` or more begins with a `minLength`-piece that occurs in `text`:
  // look for those pieces first (one scan each), so that a text holding none, the usual case,
  // costs canary.length scans instead of one per fragment (some 100 for a 20-character canary;
  // against long answers that was minutes of CPU past the audit's deadline).
  const isStartFound: boolean[] = []
  for (let start = 0; start + minLength <= canary.length; start++)
    isStartFound[start] = text.includes(canary.slice(start, start + minLength))
  if (!isStartFound.includes(true)) return null
  for (let length = canary.length; length >= minLength; length--) {
    for (let start = 0; start + length <= canary.length; start++) {
      if (!isStartFound[start]) continue
      const fragment = canary.slice(start, start + length)
      const index = text.indexOf(fragment)
      if (index >= 0) return { canary, fragment, index }
    }
  }
  return null
}

/** Every canary of `canaries` that appears (whole or as a fragment) in `text`. */
export function findCanaries(
  text: string,
  canaries: readonly string[],
  minLength: number = minFragmentLength,
): CanaryMatch[] {
  const out: CanaryMatch[] = []
  for (const canary of canaries) {
    const match = findFragment(text, canary, minLength)
    if (match) out.push(match)
  }
  return out
}

/** `text` with every character replaced by `·` except (a) occurrences of a known canary or of a
 *  fragment of one (≥ `minFragmentLength` characters) and (b) runs of ≥ `minFragmentLength`
 *  characters that occur verbatim in one of `plantedTexts` (the auditor's own synthetic prompts,
 *  so an operator sees the victim's words in the observer's answer; never customer data). Cut to
 *  at most `maxLength` characters around `around` (an index into `text`). */
export function redact(
  text: string,
  canaries: readonly string[],
  around: number = 0,
  maxLength: number = 160,
  plantedTexts: readonly string[] = [],
): string {
  const start = Math.max(0, Math.min(around - Math.floor(maxLength / 4), text.length - maxLength))
  const window = text.slice(start, start + maxLength)
  const isKept = new Uint8Array(window.length)
  for (const canary of canaries) {
    for (let i = 0; i + minFragmentLength <= canary.length; i++) {
      const piece = canary.slice(i, i + minFragmentLength)
      for (let at = window.indexOf(piece); at >= 0; at = window.indexOf(piece, at + 1)) {
        isKept.fill(1, at, at + minFragmentLength)
      }
    }
  }
  // Every window position that starts a run of ≥ minFragmentLength characters found verbatim in a
  // planted text keeps that run (longest one).
  for (let at = 0; at + minFragmentLength <= window.length; at++) {
    let longest = 0
    for (const planted of plantedTexts) {
      let n = minFragmentLength
      while (at + n <= window.length && planted.includes(window.slice(at, at + n))) n++
      longest = Math.max(longest, n - 1)
    }
    if (longest >= minFragmentLength) isKept.fill(1, at, at + longest)
  }
  let out = ''
  for (let i = 0; i < window.length; i++) out += isKept[i] ? window[i] : redactionMark
  return out
}
