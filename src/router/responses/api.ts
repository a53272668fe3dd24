/** OpenAI's Responses API on the router: `POST /v1/responses` (a generation route: parsed here,
 *  then admitted, run as chat and accounted as every generation is, ../generation.ts),
 *  `GET /v1/responses/{id}`, `GET /v1/responses/{id}/input_items` and `DELETE /v1/responses/{id}`
 *  (the tenant's own stored responses).
 *  Knows the Responses request, the store and the writer; knows nothing of backends or keys. */
import type { ServerResponse } from 'node:http'
import type { GenerationRoute } from '../generation.js'
import { sendJson } from '../api/http.js'
import type { Tenant } from '../tenants/tenants.js'
import { inputItemList, inputItemsOf, parseInputItemsQuery } from './input-items.js'
import { chatRequestOf, parseResponsesRequest } from './parse.js'
import { type ResponseShape, deletedBody } from './render.js'
import type { ResponseStore } from './store.js'
import { responsesWriter } from './write.js'

/** The prefix of response ids; the rest is the request's id (128 random bits, hex). */
export const responseIdPrefix = 'resp_'

/** The generation route of `POST /v1/responses` over `store`: a continued response
 *  (`previous_response_id`) starts from the tenant's own stored conversation (another tenant's
 *  id is the same 404 as an unknown one); a finished response with `store` is stored. */
export function responsesRoute(store: ResponseStore): GenerationRoute {
  return {
    label: 'responses',
    idPrefix: responseIdPrefix,
    parse(body, tenant, header) {
      const request = parseResponsesRequest(body)
      const previous =
        request.previousResponseId === null
          ? null
          : store.get(tenant.name, request.previousResponseId, 'previous_response_id')
      const history = previous?.conversation ?? []
      const shape: ResponseShape = {
        id: header.id,
        messageId: `msg_${header.id.slice(responseIdPrefix.length)}`,
        createdAt: header.created,
        model: header.model,
        instructions: request.instructions,
        maxOutputTokens: request.maxOutputTokens,
        previousResponseId: request.previousResponseId,
        store: request.store,
        temperature: request.temperature,
        topP: request.topP,
        metadata: request.metadata,
      }
      const writer = responsesWriter(shape, (response, text) => {
        if (!request.store) return
        const conversation = [...history, ...request.input, { role: 'assistant', content: text }]
        store.put(tenant.name, response, conversation, inputItemsOf(request.inputMessages))
      })
      return { parsed: chatRequestOf(request, history), writer }
    },
  }
}

/** `GET /v1/responses/{id}`: the tenant's stored response (404 or 400 as the store says). */
export function retrieveResponse(
  store: ResponseStore,
  tenant: Tenant,
  id: string,
  res: ServerResponse,
): void {
  sendJson(res, 200, store.get(tenant.name, id, null).body)
}

/** `GET /v1/responses/{id}/input_items` (`url`: the request's, for its query): a page of the
 *  tenant's stored response's input items; another tenant's id is the same 404 as an unknown one
 *  (the store's lookup comes before the query is read, so a bad query tells nothing either). */
export function listInputItems(
  store: ResponseStore,
  tenant: Tenant,
  id: string,
  url: string | undefined,
  res: ServerResponse,
): void {
  const { inputItems } = store.get(tenant.name, id, null)
  sendJson(res, 200, inputItemList(inputItems, parseInputItemsQuery(url)))
}

/** `DELETE /v1/responses/{id}`: deletes the tenant's stored response. */
export function deleteResponse(
  store: ResponseStore,
  tenant: Tenant,
  id: string,
  res: ServerResponse,
): void {
  store.delete(tenant.name, id)
  sendJson(res, 200, deletedBody(id))
}
