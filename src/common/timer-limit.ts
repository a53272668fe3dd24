/** The longest delay a Node.js timer holds. Shared by every bound on a configured wait: a flag,
 *  a config field or an audit budget above it would fire after 1 ms (Node's
 *  TimeoutOverflowWarning), ending things at once rather than never. */

/** Most milliseconds a Node.js timer waits: 2^31 − 1 (Node's `setTimeout` documentation). */
export const maxTimerMs = 2 ** 31 - 1

/** Most whole seconds a Node.js timer waits: `maxTimerMs` ÷ 1000, rounded down. */
export const maxTimerSeconds = Math.floor(maxTimerMs / 1000)
