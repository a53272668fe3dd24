/** The secret under which the gateway derives each tenant's `cache_salt`: from the environment
 *  (`KVFENCE_SALT_SECRET`) or a file (`router.saltSecretFile`), so that salts survive restarts
 *  and agree on every replica behind one load balancer; or none, and each router process draws
 *  its own (a single router's default).
 *  Knows environment variables and the bounded file reader; knows nothing of tenants or HTTP. */
import { KvfenceError } from '../../common/errors.js'
import { readYamlFileText } from '../../files/yaml-file.js'

/** The environment variable holding the salt secret. */
export const saltSecretEnv = 'KVFENCE_SALT_SECRET'

/** Shortest secret accepted, bytes (as long as the HMAC-SHA-256 key drawn by default). */
export const minSaltSecretBytes = 32

/** The configured salt secret (its UTF-8 bytes, surrounding white space trimmed), or null when
 *  neither `env[KVFENCE_SALT_SECRET]` nor `file` is set. The file is read with the bounded
 *  reader (a regular file, at most 16 MiB). Throws KvfenceError `config_invalid` when both are
 *  set, when the file cannot be read, or when the secret is shorter than
 *  {@link minSaltSecretBytes}; the message never holds the secret. */
export function saltSecretFrom(
  env: Readonly<Record<string, string | undefined>>,
  file: string | undefined,
): Buffer | null {
  const fromEnv = env[saltSecretEnv]
  if (fromEnv !== undefined && fromEnv !== '' && file !== undefined) {
    throw new KvfenceError(
      'config_invalid',
      `give ${saltSecretEnv} or router.saltSecretFile, not both`,
    )
  }
  let text: string
  let label: string
  if (file !== undefined) {
    label = `salt secret file ${file}`
    text = readYamlFileText(file, label, 'config_invalid')
  } else if (fromEnv !== undefined && fromEnv !== '') {
    label = saltSecretEnv
    text = fromEnv
  } else {
    return null
  }
  const secret = Buffer.from(text.trim(), 'utf8')
  if (secret.length < minSaltSecretBytes) {
    throw new KvfenceError(
      'config_invalid',
      `${label} holds ${secret.length} byte${secret.length === 1 ? '' : 's'}; a salt secret needs at least ${minSaltSecretBytes} (e.g. openssl rand -hex 32)`,
    )
  }
  return secret
}

/** Refuses a salt secret file given for native workers, where it would be silently ignored: the
 *  router's salts are sent to gateway engines only (a native prefill worker derives each tenant's
 *  salt itself). `what` names the setting (`--salt-secret-file`, `router.saltSecretFile`).
 *  @throws KvfenceError `config_invalid` when `file` is given. */
export function refuseNativeSaltSecretFile(what: string, file: string | undefined): void {
  if (file === undefined) return
  throw new KvfenceError(
    'config_invalid',
    `${what} applies to gateway mode (backend:) only: native prefill workers derive each tenant's cache salt themselves`,
  )
}
