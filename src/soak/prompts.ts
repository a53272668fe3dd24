/** The soak's prompts: filler words with the tenant's own canaries planted in them, at lengths from
 *  a few characters to past the context window. Knows text and tenants' canaries; knows nothing of
 *  HTTP or tokens (the oracle counts tokens). */
import { makeCanaries } from '../audit/canaries.js'
import type { Rng } from '../audit/rng.js'

/** Lowercase words of at most 7 letters: filler can never hold an 8-character run of a canary. */
const words = [
  'the', 'river', 'stone', 'light', 'water', 'green', 'paper', 'house', 'small', 'table',
  'music', 'bread', 'cloud', 'field', 'north', 'garden', 'window', 'summer', 'market', 'bridge',
  'and', 'with', 'from', 'over', 'near', 'after', 'walks', 'reads', 'holds', 'opens',
] // prettier-ignore

/** Canaries per tenant: a prompt plants one or two of them. */
export const canariesPerTenant = 6

/** `numTenants` lists of canaries, no two of which (across all tenants) share an 8-character
 *  fragment, so any fragment found in an answer names exactly one tenant. */
export function tenantCanaries(rng: Rng, numTenants: number): string[][] {
  const all = makeCanaries(rng, numTenants * canariesPerTenant)
  return Array.from({ length: numTenants }, (_, i) =>
    all.slice(i * canariesPerTenant, (i + 1) * canariesPerTenant),
  )
}

/** A prompt length in characters: tiny, short, medium, near the context window, or over it
 *  (up to 1.3× the window). `contextWindow` is in tokens; the bundled model has one token per
 *  character, and for other tokenizers the oracle decides what is over the context. */
export function promptLength(rng: Rng, contextWindow: number): number {
  const r = rng.next()
  if (r < 0.15) return rng.int(1, 8)
  if (r < 0.5) return rng.int(9, 120)
  if (r < 0.8) return rng.int(121, Math.max(122, Math.floor(contextWindow * 0.7)))
  if (r < 0.9) return rng.int(Math.floor(contextWindow * 0.7), contextWindow)
  return rng.int(contextWindow + 1, Math.floor(contextWindow * 1.3))
}

/** About `numChars` characters of filler holding one or two of `canaries` when they fit
 *  (a prompt shorter than a canary is plain filler, cut to length). */
export function makePrompt(rng: Rng, canaries: readonly string[], numChars: number): string {
  const planted: string[] = []
  let budget = numChars
  for (let i = 0; i < rng.int(1, 2); i++) {
    const canary = rng.pick(canaries)
    if (canary.length + 1 > budget) break
    planted.push(canary)
    budget -= canary.length + 1
  }
  const filler: string[] = []
  let length = 0
  while (length < budget) {
    const word = rng.pick(words)
    filler.push(word)
    length += word.length + 1
  }
  for (const canary of planted) filler.splice(rng.int(0, filler.length), 0, canary)
  const text = filler.join(' ')
  return text.length > numChars && planted.length === 0 ? text.slice(0, numChars) : text
}

/** A long system prompt every tenant sends now and then (shared text: the sentinel must not flag
 *  an answer that repeats it). */
export const sharedSystemPrompt =
  'You are the support assistant of the example company. Answer in English, briefly and ' +
  'politely, cite the manual where you can, never guess a price, and hand over to a person ' +
  'when the customer asks for one or is upset.'

/** A public licence paragraph (the MIT licence's first sentence) that two tenants send. */
export const sharedLicence =
  'Permission is hereby granted, free of charge, to any person obtaining a copy of this ' +
  'software and associated documentation files, to deal in the Software without restriction.'

/** Tenants that send {@link sharedLicence}: the first two. */
export const numLicenceTenants = 2

/** What goes before a prompt of tenant `tenantIndex`: the shared system prompt (a quarter of
 *  prompts), the shared licence (a quarter of the first two tenants' prompts), or nothing. */
export function sharedPrefix(rng: Rng, tenantIndex: number): string {
  const r = rng.next()
  if (r < 0.25) return `${sharedSystemPrompt} `
  if (r < 0.5 && tenantIndex < numLicenceTenants) return `${sharedLicence} `
  return ''
}
