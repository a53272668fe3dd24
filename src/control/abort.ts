/** How a request step of the control plane ends when its signal aborts: the error it fails with,
 *  and a wait that gives up on the abort. Knows AbortSignal; knows nothing of workers. */

/** The error a request step fails with when its `signal` aborts (as `http.request` fails with its
 *  `signal`): `AbortError`, code `ABORT_ERR`, the signal's reason as its cause. */
export function abortError(signal: AbortSignal): Error {
  return Object.assign(new Error('The operation was aborted', { cause: signal.reason }), {
    name: 'AbortError',
    code: 'ABORT_ERR',
  })
}

/** `waiting` (a promise shared by many requests, such as a channel being opened or a probe), or
 *  this request's {@link abortError} as soon as `signal` fires: a request must not wait out a
 *  worker that does not answer (a stopped one) once its client has gone or the drain's deadline
 *  has passed; what it waited on goes on for the others. */
export function untilAborted<T>(waiting: Promise<T>, signal: AbortSignal): Promise<T> {
  if (signal.aborted) return Promise.reject(abortError(signal))
  return new Promise<T>((resolve, reject) => {
    const onAbort = () => reject(abortError(signal))
    signal.addEventListener('abort', onAbort, { once: true })
    waiting.then(
      (value) => {
        signal.removeEventListener('abort', onAbort)
        resolve(value)
      },
      (err: unknown) => {
        signal.removeEventListener('abort', onAbort)
        reject(err as Error)
      },
    )
  })
}
