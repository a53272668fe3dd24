/** A real `redis-server` for the tests and the bench: on a free loopback port, in a temporary
 *  directory, persisting nothing (`--save '' --appendonly no`); stopped and started again on the
 *  same port to play an outage. And what the tests of router replicas share: a stand-in vLLM whose
 *  streams hold a request for 3 s, and a chat request to a replica. Not a test file itself. */
import { type ChildProcess, spawn } from 'node:child_process'
import { existsSync } from 'node:fs'
import net from 'node:net'
import { type Engine, startEngine } from '../../helpers/engines.js'
import { freePort } from '../../reliability/helpers.js'
import { tempDir } from '../../helpers/temp-dir.js'

/** Debian's redis-server. */
export const redisServerPath = '/usr/bin/redis-server'

/** Why the Redis tests cannot run here, or null when they can. */
export function redisSkipReason(): string | null {
  return existsSync(redisServerPath)
    ? null
    : `${redisServerPath} is absent (apt-get install redis-server)`
}

/** A running redis-server. */
export interface RedisServer {
  readonly url: string
  readonly port: number
  /** SIGKILLs it and waits for the exit. */
  kill(): Promise<void>
  /** Starts it again on the same port (empty: nothing was persisted). */
  restart(): Promise<void>
}

/** Starts a redis-server; resolves once it accepts connections. */
export async function startRedis(): Promise<RedisServer> {
  const port = await freePort()
  const dir = tempDir('kvfence-redis-')
  let child: ChildProcess | null = null
  const start = async () => {
    child = spawn(
      redisServerPath,
      [
        '--port',
        String(port),
        '--bind',
        '127.0.0.1',
        '--save',
        '',
        '--appendonly',
        'no',
        '--dir',
        dir,
      ],
      { stdio: 'ignore' },
    )
    for (let i = 0; i < 100; i++) {
      if (await accepts(port)) return
      await new Promise((r) => setTimeout(r, 50))
    }
    throw new Error(`redis-server did not listen on ${port}`)
  }
  await start()
  return {
    url: `redis://127.0.0.1:${port}`,
    port,
    async kill() {
      const c = child
      if (c === null || c.exitCode !== null) return
      await new Promise<void>((resolve) => {
        c.once('exit', () => resolve())
        c.kill('SIGKILL')
      })
      child = null
    },
    restart: start,
  }
}

function accepts(port: number): Promise<boolean> {
  return new Promise((resolve) => {
    const socket = net.connect(port, '127.0.0.1')
    socket.once('connect', () => {
      socket.destroy()
      resolve(true)
    })
    socket.once('error', () => resolve(false))
  })
}

/** A stand-in vLLM for router replicas: a streamed reply is 30 tokens 100 ms apart (it holds its
 *  request for 3 s), a reply not streamed comes at once (30 tokens too). */
export function startHoldingEngine(): Promise<Engine> {
  return startEngine('vllm', {
    poolTokens: 8192,
    maxModelLen: 2048,
    tokenDelayMs: 100,
    numTokens: 30,
  })
}

/** A chat completion of tenant `key` through the router at `url`; resolves with the response
 *  (its body unread when streamed). */
export function replicaChat(
  url: string,
  key: string,
  stream: boolean,
  maxTokens = 30,
): Promise<Response> {
  return fetch(`${url}/v1/chat/completions`, {
    method: 'POST',
    headers: { authorization: `Bearer ${key}`, 'content-type': 'application/json' },
    body: JSON.stringify({
      model: 'tiny-engine',
      messages: [{ role: 'user', content: 'one two three four five six seven eight nine ten' }],
      max_tokens: maxTokens,
      stream,
    }),
  })
}
