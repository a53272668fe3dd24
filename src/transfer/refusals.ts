/** Why a transfer ends without success: a stable reason slug for every check of the transfer
 *  protocol, carried as the first word of the error's message ("<reason>: <detail>") so that both
 *  sides, logs and tests can tell one refusal from another without parsing prose.
 *  Knows reasons and error codes; knows nothing of sockets or pools. */
import { KvfenceError, type ErrorCode } from '../errors.js'
import type { FrameErrorReason } from './frames.js'

/** Every reason a transfer or connection can be refused or torn down. */
export type RefusalReason =
  | FrameErrorReason
  // connection
  | 'unsupported_version'
  | 'unexpected_frame'
  | 'connection_closed'
  | 'server_closed'
  | 'client_closed'
  // BEGIN
  | 'unknown_request'
  | 'bad_hmac'
  | 'duplicate_transfer'
  | 'counts_mismatch'
  // PAGES / END
  | 'unknown_transfer'
  | 'request_mismatch'
  | 'ordinal_out_of_range'
  | 'page_bytes_mismatch'
  | 'page_overfull'
  | 'page_out_of_order'
  | 'tokens_mismatch'
  | 'checksum_mismatch'
  | 'incomplete'
  | 'manifest_mismatch'
  | 'bad_end_mac'
  // either side
  | 'stalled'
  | 'aborted_by_sender'
  | 'refused_by_receiver'
  | 'unexpected_ack'
  | 'hook_failed'

/** A KvfenceError whose message is `"<reason>: <detail>"`. */
export function refusal(
  reason: RefusalReason,
  detail: string,
  code: ErrorCode = 'transfer_failed',
): KvfenceError {
  return new KvfenceError(code, `${reason}: ${detail}`)
}

/** The reason slug at the start of an error message ("checksum_mismatch: ..." → "checksum_mismatch"),
 *  or null if the message does not start with one. */
export function reasonOf(err: unknown): string | null {
  if (!(err instanceof Error)) return null
  const match = /^([a-z_]+):/.exec(err.message)
  return match ? match[1] : null
}

/** `err` as a KvfenceError: itself if it is one, else `internal_error` naming `what` failed. */
export function asKvfenceError(err: unknown, what: string): KvfenceError {
  if (err instanceof KvfenceError) return err
  return refusal(
    'hook_failed',
    `${what}: ${err instanceof Error ? err.message : String(err)}`,
    'internal_error',
  )
}
