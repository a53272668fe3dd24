/** A prompt's token ids: a completion's text encoded (or its ids range-checked), a chat's
 *  template rendered and encoded, text the tokenizer would drop refused. What the router's
 *  tokenizer processes run (tokenizer-process.ts), so it imports nothing heavier than the
 *  tokenizer: each process loads it at start.
 *  Knows the tokenizer and parsed requests; knows nothing of admission, workers or HTTP. */
import { KvfenceError } from '../../common/errors.js'
import {
  type ChatMessage,
  type Tokenizer,
  unrepresentableTextError,
} from '../../model/tokenizer.js'
import type { ParsedChatRequest, ParsedRequest } from '../api/schemas.js'

/** Prompt token ids of a chat: the chat template's text, encoded. BOS is added by the encoder
 *  unless the template already wrote it (so that it is never doubled). */
export function chatPromptTokenIds(
  tokenizer: Tokenizer,
  messages: readonly ChatMessage[],
): number[] {
  const text = tokenizer.applyChatTemplate(messages)
  return tokenizer.encode(text, { addSpecialTokens: !hasLeadingBos(tokenizer, text) })
}

/** Whether a chat template's `text` already begins with the BOS token (so the encoder must not
 *  add another). */
export function hasLeadingBos(tokenizer: Tokenizer, text: string): boolean {
  return tokenizer.bosToken !== null && text.startsWith(tokenizer.bosToken)
}

/** `ids` of a completion's text, refused (`invalid_request`, param `prompt`) when there are none. */
export function checkedNotEmpty(ids: number[]): number[] {
  if (ids.length === 0) {
    throw new KvfenceError('invalid_request', 'prompt encodes to no tokens', 'prompt')
  }
  return ids
}

/** Prompt token ids of a completion: the text encoded (BOS per the tokenizer), or the client's
 *  token ids as they are after a range check. Throws `invalid_request` (param `prompt`). */
export function completionPromptTokenIds(
  tokenizer: Tokenizer,
  prompt: { text: string } | { tokenIds: number[] },
): number[] {
  if ('text' in prompt) return checkedNotEmpty(tokenizer.encode(prompt.text))
  const bad = prompt.tokenIds.find((id) => id >= tokenizer.vocabSize)
  if (bad !== undefined) {
    throw new KvfenceError(
      'invalid_request',
      `token id ${bad} is out of range: the vocabulary has ${tokenizer.vocabSize} tokens`,
      'prompt',
    )
  }
  return prompt.tokenIds
}

/** Prompt token ids of a parsed request of either endpoint (see the two functions above). */
export function promptTokenIds(tokenizer: Tokenizer, parsed: ParsedRequest): number[] {
  return parsed.endpoint === 'chat'
    ? chatPromptTokenIds(tokenizer, parsed.messages)
    : completionPromptTokenIds(tokenizer, parsed.prompt)
}

/** A prompt's ids with its lost text refused: what the processes (and inline calls) run. The text
 *  is encoded once: the ids the workers get are the ones the check decoded (a chat's rendered
 *  prompt is checked whole; only when it loses a character are the messages checked one by one,
 *  to name the one that holds it). */
export function checkedPromptTokenIds(tokenizer: Tokenizer, parsed: ParsedRequest): number[] {
  if (parsed.endpoint === 'chat') {
    const text = tokenizer.applyChatTemplate(parsed.messages)
    const { ids, lost } = tokenizer.encodeChecked(text, {
      addSpecialTokens: !hasLeadingBos(tokenizer, text),
    })
    if (lost !== null) throw lostInMessages(tokenizer, parsed, lost)
    return ids
  }
  if (!('text' in parsed.prompt)) return completionPromptTokenIds(tokenizer, parsed.prompt)
  const { ids, lost } = tokenizer.encodeChecked(parsed.prompt.text)
  if (lost !== null) throw unrepresentableTextError(lost, 'prompt')
  return checkedNotEmpty(ids)
}

/** The error for a chat whose rendered prompt loses `lost`: the first message that loses a
 *  character on its own is named, as the character it loses; else (lost only in context, or in
 *  the template's own text) the messages as a whole. */
function lostInMessages(
  tokenizer: Tokenizer,
  parsed: ParsedChatRequest,
  lost: string,
): KvfenceError {
  for (const [i, m] of parsed.messages.entries()) {
    const first = tokenizer.firstLostCharacter(m.content)
    const param = parsed.messageParams?.[i] ?? `messages[${i}].content`
    if (first !== null) return unrepresentableTextError(first, param)
  }
  return unrepresentableTextError(lost, parsed.promptParam ?? 'messages')
}
