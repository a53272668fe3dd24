/** The P → D KV transfer (DESIGN.md §6; guards G4, G7, G9, G10): the public API.
 *  P uses {@link TransferClient}; D runs a {@link TransferServer} with {@link ReceiverHooks}.
 *  The wire format is in frames.ts and docs/protocol.md. */
export { TransferClient, senderConfig } from './sender.js'
export type {
  OutgoingTransfer,
  SenderConfig,
  TransferClientOptions,
  TransferClientStats,
} from './sender.js'
export { TransferServer, receiverConfig } from './receiver.js'
export type {
  BeginInfo,
  ReceiverConfig,
  ReceiverHooks,
  Reservation,
  TransferLog,
  TransferServerOptions,
  TransferServerStats,
} from './receiver.js'
export { PROTOCOL_VERSION, newTransferId, isHexId, DEFAULT_MAX_FRAME_BYTES } from './frames.js'
export { TransferError, type RefusalReason } from './refusals.js'
