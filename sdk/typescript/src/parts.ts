/**
 * Payloads and their parts as plain values: a data part is built from, and read back as, a
 * plain JSON object (`google.protobuf.Value` on the wire), a text part from a string.
 *
 * ```ts
 * const payload = makePayload("complaint.submitted", dataPart({ complaint_id: "1", narrative: "..." }));
 * const reply = firstData(result.message.payload); // { category: "servicing", confidence: 0.8, ... }
 * ```
 *
 * @module
 */

import { create, fromJson, type JsonObject, type JsonValue, toJson } from "@bufbuild/protobuf";
import { type Value, ValueSchema } from "@bufbuild/protobuf/wkt";

import { type Part, PartSchema, type Payload, PayloadSchema } from "./gen/reach/v1/envelope_pb.js";

/** Optional fields of a part. */
export interface PartOptions {
  /** The IANA media type of the content (for example `application/json`). */
  mediaType?: string | undefined;
  /** A file name for raw or url content. */
  filename?: string | undefined;
}

/** A text part carrying `text` (media type `text/plain` unless `options` say otherwise). */
export function textPart(text: string, options: PartOptions = {}): Part {
  return create(PartSchema, {
    content: { case: "text", value: text },
    mediaType: options.mediaType ?? "text/plain",
    filename: options.filename ?? "",
  });
}

/**
 * A data part carrying `data`, a JSON value (usually an object), as `google.protobuf.Value`
 * (media type `application/json` unless `options` say otherwise).
 *
 * @throws {Error} when `data` is not JSON (a number that is not finite, for example).
 */
export function dataPart(data: JsonValue, options: PartOptions = {}): Part {
  return create(PartSchema, {
    content: { case: "data", value: valueOf(data) },
    mediaType: options.mediaType ?? "application/json",
    filename: options.filename ?? "",
  });
}

/** A part carrying raw `bytes` (media type `application/octet-stream` unless given). */
export function rawPart(bytes: Uint8Array, options: PartOptions = {}): Part {
  return create(PartSchema, {
    content: { case: "raw", value: bytes },
    mediaType: options.mediaType ?? "application/octet-stream",
    filename: options.filename ?? "",
  });
}

/** A part that points to its content at `url`. */
export function urlPart(url: string, options: PartOptions = {}): Part {
  return create(PartSchema, {
    content: { case: "url", value: url },
    mediaType: options.mediaType ?? "",
    filename: options.filename ?? "",
  });
}

/**
 * A payload of message type `type` (as declared in the protocol registry, or your own dotted
 * name) with `parts` in order.
 */
export function makePayload(type: string, ...parts: Part[]): Payload {
  return create(PayloadSchema, { type, parts });
}

/** The JSON value of a data part; `undefined` for a part of another kind. */
export function partData(part: Part): JsonValue | undefined {
  return part.content.case === "data" ? toJson(ValueSchema, part.content.value) : undefined;
}

/** The text of a text part; `undefined` for a part of another kind. */
export function partText(part: Part): string | undefined {
  return part.content.case === "text" ? part.content.value : undefined;
}

/**
 * The first data part of `payload` as a plain object — what a capability's input and output
 * schemas describe. `undefined` when the payload has no data part or its first data part is
 * not an object.
 */
export function firstData(payload: Payload | undefined): JsonObject | undefined {
  for (const part of payload?.parts ?? []) {
    const data = partData(part);
    if (data !== undefined) {
      return isJsonObject(data) ? data : undefined;
    }
  }
  return undefined;
}

/** The text of the first text part of `payload`; `undefined` when it has none. */
export function firstText(payload: Payload | undefined): string | undefined {
  for (const part of payload?.parts ?? []) {
    const text = partText(part);
    if (text !== undefined) {
      return text;
    }
  }
  return undefined;
}

/** `json` as a `google.protobuf.Value` (for task inputs and other Value fields). */
export function valueOf(json: JsonValue): Value {
  return fromJson(ValueSchema, json);
}

/** A `google.protobuf.Value` field as JSON; `undefined` when the field is unset. */
export function jsonOf(value: Value | undefined): JsonValue | undefined {
  return value === undefined ? undefined : toJson(ValueSchema, value);
}

function isJsonObject(value: JsonValue): value is JsonObject {
  return typeof value === "object" && value !== null && !Array.isArray(value);
}
