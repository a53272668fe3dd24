/** Shared set-up for tests against a real cluster (src/config/launch.ts): the incident's pool
 *  shape, a temporary folder with a tenants file of two tenants, an `openai` client, and the
 *  workers' `/server_info`. */
import assert from 'node:assert/strict'
import { mkdtempSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import OpenAI from 'openai'
import { Agent, fetch as undiciFetch } from 'undici'
import { newApiKey, tenantsYaml } from '../../src/router/tenants/tenant-keys.js'
import type { ServerInfo } from '../../src/control/messages.js'
import type { Oracle } from '../../src/soak/oracle.js'

/** The incident's pools, scaled down to the bundled model (the demo's shape): prefill
 *  24 pages × 16 = 384 tokens, decode 64 × 16 = 1,024 tokens. */
export const incidentShape = Object.freeze({ pageSize: 16, prefillPages: 24, decodePages: 64 })

/** A tenant of a test cluster, with its plain API key. */
export interface TestTenant {
  name: string
  key: string
}

/** A fresh folder (`mkdtemp` under the OS temp dir, named `prefix…`) holding `tenants.yaml` with
 *  `tenant-a` and `tenant-b`, each with a new API key. */
export function twoTenants(prefix: string): {
  dir: string
  tenants: [TestTenant, TestTenant]
  tenantsFile: string
} {
  const dir = mkdtempSync(join(tmpdir(), prefix))
  const tenants: [TestTenant, TestTenant] = [
    { name: 'tenant-a', key: newApiKey() },
    { name: 'tenant-b', key: newApiKey() },
  ]
  const tenantsFile = join(dir, 'tenants.yaml')
  writeFileSync(tenantsFile, tenantsYaml(tenants))
  return { dir, tenants, tenantsFile }
}

/** The official `openai` client for the router at `baseURL`, with no retries (a test sees every
 *  answer as sent) and a `timeoutMs` timeout. */
export function openaiClient(baseURL: string, key: string, timeoutMs = 60_000): OpenAI {
  return new OpenAI({ baseURL: `${baseURL}/v1`, apiKey: key, maxRetries: 0, timeout: timeoutMs })
}

/** The `openai` client for an HTTPS router at `baseURL` (ending in `/v1`) trusting `ca` (PEM), with
 *  no retries, and the undici agent that trusts it (close it when done). */
export function openaiTrusting(
  baseURL: string,
  apiKey: string,
  ca: Buffer,
): { client: OpenAI; agent: Agent } {
  const agent = new Agent({ connect: { ca } })
  const client = new OpenAI({
    baseURL,
    apiKey,
    maxRetries: 0,
    fetch: ((url: string, init: RequestInit) =>
      undiciFetch(url, { ...(init as object), dispatcher: agent })) as unknown as typeof fetch,
  })
  return { client, agent }
}

/** The `--tls-ca/--tls-cert/--tls-key` flags of `part` with the files of the `certs init` folder
 *  `certs`. */
export function tlsFlags(certs: string, part: string): string[] {
  return [
    '--tls-ca',
    join(certs, 'ca.crt'),
    '--tls-cert',
    join(certs, `${part}.crt`),
    '--tls-key',
    join(certs, `${part}.key`),
  ]
}

/** A `maxTokens`-token completion of `prompt` through `client` is exactly the single-process
 *  engine's (the echo model). */
export async function completesAsOracle(
  client: OpenAI,
  oracle: Oracle,
  prompt: string,
  maxTokens = 12,
): Promise<void> {
  const completion = await client.completions.create({
    model: 'echo-tiny',
    prompt,
    max_tokens: maxTokens,
    temperature: 0,
  })
  assert.equal(
    completion.choices[0].text,
    oracle.expected({ endpoint: 'completion', prompt, maxTokens }).text,
  )
}

/** A worker's `/server_info` (not validated: the tests compare its fields). */
export async function serverInfo(url: string): Promise<ServerInfo> {
  return (await (await fetch(`${url}/server_info`)).json()) as ServerInfo
}

/** Used pages of [prefill, decode]. */
export async function pagesUsed(cluster: {
  prefillUrl: string
  decodeUrl: string
}): Promise<number[]> {
  return Promise.all(
    [cluster.prefillUrl, cluster.decodeUrl].map(
      async (url) => (await serverInfo(url)).numPagesUsed,
    ),
  )
}
