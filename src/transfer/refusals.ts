/** Why a transfer ends without success: a stable reason slug for every check of the transfer
 *  protocol, carried as {@link TransferError.reason} and also as the first word of the error's
 *  message ("<reason>: <detail>"), which is what a NACK puts on the wire, so that both sides, logs
 *  and tests can tell one refusal from another without parsing prose.
 *  Knows reasons and error codes; knows nothing of sockets or pools. */
import { KvfenceError, type ErrorCode } from '../common/errors.js'

/** Every reason a transfer or connection can be refused or torn down. */
export const refusalReasons = [
  // stream-level and frame decoding (frames.ts FrameErrorReason)
  'bad_magic',
  'bad_flags',
  'unknown_kind',
  'frame_too_large',
  'malformed_frame',
  // connection
  'unsupported_version',
  'unexpected_frame',
  'connection_closed',
  'server_closed',
  'client_closed',
  // BEGIN
  'unknown_request',
  'bad_hmac',
  'duplicate_transfer',
  'counts_mismatch',
  // PAGES / END
  'unknown_transfer',
  'request_mismatch',
  'ordinal_out_of_range',
  'page_bytes_mismatch',
  'page_overfull',
  'page_out_of_order',
  'tokens_mismatch',
  'checksum_mismatch',
  'incomplete',
  'manifest_mismatch',
  'bad_end_mac',
  // either side
  'stalled',
  'aborted_by_sender',
  'refused_by_receiver',
  'unexpected_ack',
  'hook_failed',
] as const

/** One of {@link refusalReasons}. */
export type RefusalReason = (typeof refusalReasons)[number]

const knownReasons: ReadonlySet<string> = new Set(refusalReasons)

/** A transfer refusal: a KvfenceError with a typed reason. Its message is `"<reason>: <detail>"`
 *  (what a NACK carries and logs show), except for refusals read off a NACK, which keep the
 *  receiver's message as it came (see {@link refusalFromWire}). */
export class TransferError extends KvfenceError {
  constructor(
    readonly reason: RefusalReason,
    code: ErrorCode,
    message: string,
  ) {
    super(code, message)
    this.name = 'TransferError'
  }
}

/** A TransferError whose message is `"<reason>: <detail>"`. */
export function refusal(
  reason: RefusalReason,
  detail: string,
  code: ErrorCode = 'transfer_failed',
): TransferError {
  return new TransferError(reason, code, `${reason}: ${detail}`)
}

/** The refusal a peer's NACK message stands for, keeping `message` as it is: its reason is the
 *  message's first word when that is a known reason, else `refused_by_receiver` (a hook's own
 *  error, or a newer peer's reason). The one place a reason is read back from text: the wire. */
export function refusalFromWire(wireMessage: string, message = wireMessage): TransferError {
  const slug = /^([a-z_]+):/.exec(wireMessage)?.[1]
  const reason = slug !== undefined && knownReasons.has(slug) ? (slug as RefusalReason) : null
  return new TransferError(reason ?? 'refused_by_receiver', 'transfer_failed', message)
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
