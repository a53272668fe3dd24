/** Secrets in a body an endpoint served: the auditor's own tenant keys anywhere in it; JSON fields
 *  named like a credential (`api_key`, `admin_api_key`, `password`, `ssl_keyfile_password`,
 *  `token`, `secret`, …) holding a non-empty string; `Bearer …` tokens; PEM private-key blocks;
 *  `key=value` pairs of those names in text (Prometheus labels, logs). SGLang's `/server_info`
 *  serialized its whole ServerArgs, `api_key` and `admin_api_key` included (sglang#30166).
 *  A hit never holds the secret: only where it was, what kind, and its length.
 *  Knows JSON and text; knows nothing of HTTP. */

/** What kind of secret was seen. `tenant-key`: one of the auditor's own tenant keys. */
export type SecretKind = 'tenant-key' | 'credential-field' | 'bearer-token' | 'private-key'

export interface SecretHit {
  readonly kind: SecretKind
  /** Where: a JSON path (`server_args.api_key`), or the pattern's name in text. */
  readonly field: string
  /** With `tenant-key`: whose key. */
  readonly tenant?: string
  /** The secret's length in characters; the value itself is never kept. */
  readonly length: number
}

/** A field name of a credential: the whole name, or its last `_`/`-`/`.`-separated part(s).
 *  `eos_token`, `bos_token`, `max_tokens`, `tokenizer` are not (a token of the vocabulary). */
const credentialName =
  /(^|[_.-])(api[_-]?key|apikey|password|passwd|secret|client[_-]?secret|access[_-]?token|auth[_-]?token|bearer[_-]?token|refresh[_-]?token|hf[_-]?token|private[_-]?key)$|^(token|authorization)$/i
/** Values that say "no secret here". */
const emptyValue = /^(|none|null|nil|false|undefined|\*+|x+|<redacted>|\[redacted\]|redacted)$/i
const bearer = /\bBearer\s+([A-Za-z0-9._~+/=-]{8,})/g
const privateKeyBlock = /-----BEGIN [A-Z ]*PRIVATE KEY-----/g
const textPair =
  /\b([A-Za-z_]*(?:api[_-]?key|password|passwd|secret|access[_-]?token|auth[_-]?token))\s*[=:]\s*"?([^\s",}&]+)/gi

/** The secrets in `body` (JSON or text). `tenants`: the auditor's keys (shorter than 8
 *  characters: not looked for, they would match by chance). */
export function findSecrets(
  body: string,
  tenants: readonly { readonly name: string; readonly key: string }[],
): SecretHit[] {
  const hits: SecretHit[] = []
  for (const t of tenants)
    if (t.key.length >= 8 && body.includes(t.key))
      hits.push({
        kind: 'tenant-key',
        field: 'anywhere in the body',
        tenant: t.name,
        length: t.key.length,
      })
  const json = parseJson(body)
  if (json !== undefined) walk(json, '', hits)
  else
    for (const m of body.matchAll(textPair))
      if (!emptyValue.test(m[2]))
        hits.push({ kind: 'credential-field', field: m[1], length: m[2].length })
  for (const m of body.matchAll(bearer))
    hits.push({ kind: 'bearer-token', field: 'Bearer token', length: m[1].length })
  for (const m of body.matchAll(privateKeyBlock))
    hits.push({
      kind: 'private-key',
      field: m[0].slice('-----BEGIN '.length, -'-----'.length),
      length: m[0].length,
    })
  return hits
}

function walk(value: unknown, path: string, hits: SecretHit[]): void {
  if (Array.isArray(value)) {
    value.forEach((v, i) => walk(v, `${path}[${i}]`, hits))
    return
  }
  if (value === null || typeof value !== 'object') return
  for (const [name, v] of Object.entries(value)) {
    const at = path === '' ? name : `${path}.${name}`
    if (typeof v === 'string' && credentialName.test(name) && !emptyValue.test(v.trim()))
      hits.push({ kind: 'credential-field', field: at, length: v.length })
    else walk(v, at, hits)
  }
}

function parseJson(text: string): unknown {
  try {
    return JSON.parse(text) as unknown
  } catch {
    return undefined
  }
}
