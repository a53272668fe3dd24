/** The watch's hourly budget: at most `maxTokens` tokens and `maxRequests` requests in any
 *  sliding hour. A cycle reserves its planned upper bound before it sends anything and settles
 *  to what it really spent afterwards, so the limit holds even while a cycle is in flight.
 *  Tokens are prompt plus `max_tokens` of every completion; reads (`/v1/models`, `/metrics`…)
 *  are requests of 0 tokens.
 *  Knows numbers and time; knows nothing of HTTP. */

/** Spending in one entry of the window. */
export interface Spend {
  readonly tokens: number
  readonly requests: number
}

const hourMs = 3_600_000

interface Entry {
  readonly atMs: number
  tokens: number
  requests: number
}

/** What a reservation holds until it is settled. */
export interface Reservation {
  /** Replaces the reserved amounts by what was really spent (never more than reserved). */
  settle(spent: Spend): void
}

export class HourlyBudget {
  private readonly entries: Entry[] = []

  constructor(
    readonly maxTokens: number,
    readonly maxRequests: number,
    private readonly now: () => number = Date.now,
  ) {}

  /** Spent in the last hour (reservations included). */
  spentInWindow(): Spend {
    this.expire()
    let tokens = 0
    let requests = 0
    for (const e of this.entries) {
      tokens += e.tokens
      requests += e.requests
    }
    return { tokens, requests }
  }

  /** What may still be spent now without breaking either limit. */
  remaining(): Spend {
    const spent = this.spentInWindow()
    return {
      tokens: Math.max(0, this.maxTokens - spent.tokens),
      requests: Math.max(0, this.maxRequests - spent.requests),
    }
  }

  /** Reserves `amount`, or returns null when it does not fit in what remains. */
  reserve(amount: Spend): Reservation | null {
    const left = this.remaining()
    if (amount.tokens > left.tokens || amount.requests > left.requests) return null
    const entry: Entry = { atMs: this.now(), tokens: amount.tokens, requests: amount.requests }
    this.entries.push(entry)
    return {
      settle: (spent) => {
        entry.tokens = Math.min(entry.tokens, spent.tokens)
        entry.requests = Math.min(entry.requests, spent.requests)
      },
    }
  }

  /** Invariant: the window never holds more than the limits. */
  check(): void {
    const spent = this.spentInWindow()
    if (spent.tokens > this.maxTokens || spent.requests > this.maxRequests) {
      throw new Error(
        `hourly budget broken: ${spent.tokens}/${this.maxTokens} tokens, ${spent.requests}/${this.maxRequests} requests`,
      )
    }
  }

  private expire(): void {
    const cutoff = this.now() - hourMs
    while (this.entries.length > 0 && this.entries[0].atMs <= cutoff) this.entries.shift()
  }
}

/** Paces cycles inside the hourly limit: refills at the hourly rate, holds at most `capacity`
 *  (a few cycles' worth), so a cycle may spend more than its average share now and then without
 *  the hour's budget going in the first quarter hour. The hard limit stays {@link HourlyBudget}. */
export class PacingBucket {
  private level: { tokens: number; requests: number }
  private refilledAt: number

  constructor(
    private readonly perHour: Spend,
    readonly capacity: Spend,
    private readonly now: () => number = Date.now,
  ) {
    this.level = { ...capacity }
    this.refilledAt = now()
  }

  /** What the bucket holds now. */
  available(): Spend {
    const t = this.now()
    const hours = (t - this.refilledAt) / hourMs
    this.refilledAt = t
    this.level = {
      tokens: Math.min(this.capacity.tokens, this.level.tokens + hours * this.perHour.tokens),
      requests: Math.min(
        this.capacity.requests,
        this.level.requests + hours * this.perHour.requests,
      ),
    }
    return { tokens: Math.floor(this.level.tokens), requests: Math.floor(this.level.requests) }
  }

  /** Takes what a cycle spent out of the bucket. */
  take(spent: Spend): void {
    this.available()
    this.level = {
      tokens: this.level.tokens - spent.tokens,
      requests: this.level.requests - spent.requests,
    }
  }
}
