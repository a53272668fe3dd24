/** Refusals carry a typed reason: made here with `refusal`, or read once off a peer's NACK. */
import assert from 'node:assert/strict'
import { describe, it } from 'node:test'
import { KvfenceError } from '../../src/common/errors.js'
import { refusal, refusalFromWire, TransferError } from '../../src/transfer/refusals.js'

describe('refusals', () => {
  it('refusal() is a TransferError with the reason as a field and as the message’s first word', () => {
    const err = refusal('checksum_mismatch', 'transfer t page 3')
    assert.ok(err instanceof TransferError)
    assert.ok(err instanceof KvfenceError)
    assert.equal(err.reason, 'checksum_mismatch')
    assert.equal(err.code, 'transfer_failed')
    assert.equal(err.message, 'checksum_mismatch: transfer t page 3')
    assert.equal(refusal('aborted_by_sender', 'x', 'request_aborted').code, 'request_aborted')
  })

  it('refusalFromWire reads a known reason off a NACK message and keeps the message as given', () => {
    const err = refusalFromWire(
      'bad_end_mac: transfer t',
      'bad_end_mac: transfer t [decode worker]',
    )
    assert.equal(err.reason, 'bad_end_mac')
    assert.equal(err.code, 'transfer_failed')
    assert.equal(err.message, 'bad_end_mac: transfer t [decode worker]')
  })

  it('refusalFromWire reads a message without a known reason as refused_by_receiver', () => {
    for (const message of ['transfer t: no reservation waiting', 'newer_reason: x', '', 'Bad: x'])
      assert.equal(refusalFromWire(message).reason, 'refused_by_receiver', message)
  })
})
