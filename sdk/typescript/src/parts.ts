/**
 * Payloads and their parts as plain values: a data part is built from, and read back as, a
 * plain JSON object (`google.protobuf.Value` on the wire), a text part from a string.
 *
 * ```ts
 * const payload = makePayload("complaint.submitted", dataPart({ complaint_id: "1", narrative: "..." }));
 * const reply = firstData(result.message.payload); // { category: "servicing", confidence: 0.8, ... }
 * ```
 *
 * A data part's value nests at most {@link MAX_DATA_DEPTH} levels (each object or array is one).
 *
 * @module
 */

import { create, fromJson, type JsonObject, type JsonValue, toJson } from "@bufbuild/protobuf";
import { type Value, ValueSchema } from "@bufbuild/protobuf/wkt";

import { type Part, PartSchema, type Payload, PayloadSchema } from "./gen/reach/v1/envelope_pb.js";

/**
 * The deepest a data part's JSON value may nest, in levels: each object or array is one level,
 * a scalar none (`{"a": [1]}` nests 2). `dataPart` refuses deeper values, `MeshClient` deeper
 * messages (INVALID_ARGUMENT / `INVALID_PAYLOAD`), an agent replies deeper than this with
 * INTERNAL, and the router refuses deeper messages. Protobuf decoders (prost, upb) stop at 100
 * nested messages, and in a multiplexed frame (`CallMuxRequest`, `HandleMuxRequest`) the data's
 * outermost `Value` is already the 5th (frame, message, payload, part, value); each object level
 * adds 3 (`Struct`, its map entry, the inner `Value`), each array level 2. 31 object levels end
 * at 98; 32 would end at 101, and an undecodable frame ends the stream other calls share.
 */
export const MAX_DATA_DEPTH = 31;

/** A JSON value nests deeper than {@link MAX_DATA_DEPTH} levels. */
export class DataTooDeepError extends TypeError {
  /** How many levels the whole value nests. */
  readonly depth: number;
  /** {@link MAX_DATA_DEPTH}. */
  readonly limit = MAX_DATA_DEPTH;
  /** Where the first level past the limit begins (`$.a.b[0]`). */
  readonly path: string;

  constructor(depth: number, path: string) {
    super(
      `the data nests ${depth} levels deep, over the limit of ${MAX_DATA_DEPTH} (MAX_DATA_DEPTH): level ${MAX_DATA_DEPTH + 1} begins at ${path}; flatten it (each object or array is one level)`,
    );
    this.name = "DataTooDeepError";
    this.depth = depth;
    this.path = path;
  }
}

/**
 * How many levels `json` nests: 0 for a scalar, one more than its deepest element for an object
 * or array (an empty one nests 1). Walks with an explicit stack, so any value is safe to measure.
 */
export function dataDepth(json: JsonValue): number {
  return measure(json).depth;
}

/** A value's depth, and the path where it first goes past {@link MAX_DATA_DEPTH}, if it does. */
function measure(json: JsonValue): { depth: number; tooDeepAt: string | undefined } {
  interface Entry {
    value: JsonValue;
    level: number;
    parent: Entry | undefined;
    step: string;
  }
  let deepest = 0;
  let tooDeep: Entry | undefined;
  const stack: Entry[] = [{ value: json, level: 0, parent: undefined, step: "$" }];
  for (let entry = stack.pop(); entry !== undefined; entry = stack.pop()) {
    const { value, level } = entry;
    if (typeof value !== "object" || value === null) {
      continue;
    }
    deepest = Math.max(deepest, level + 1);
    if (level === MAX_DATA_DEPTH) {
      tooDeep ??= entry;
    }
    const children: Array<[string, JsonValue]> = Array.isArray(value)
      ? value.map((item, index) => [`[${index}]`, item])
      : Object.entries(value).map(([key, item]) => [`.${key}`, item]);
    // Reversed, so the first child is measured first and a path names the first excess.
    for (let index = children.length - 1; index >= 0; index -= 1) {
      const [step, item] = children[index]!;
      stack.push({ value: item, level: level + 1, parent: entry, step });
    }
  }
  let path = "";
  for (let at = tooDeep; at !== undefined; at = at.parent) {
    path = at.step + path;
  }
  return { depth: deepest, tooDeepAt: tooDeep === undefined ? undefined : path };
}

/** How many levels a `google.protobuf.Value` nests (as {@link dataDepth}). */
function valueDepth(value: Value): number {
  let deepest = 0;
  const stack: Array<[Value, number]> = [[value, 0]];
  for (let entry = stack.pop(); entry !== undefined; entry = stack.pop()) {
    const [item, level] = entry;
    const kind = item.kind;
    const children =
      kind.case === "structValue"
        ? Object.values(kind.value.fields)
        : kind.case === "listValue"
          ? kind.value.values
          : undefined;
    if (children !== undefined) {
      deepest = Math.max(deepest, level + 1);
      for (const child of children) {
        stack.push([child, level + 1]);
      }
    }
  }
  return deepest;
}

/**
 * The first data part of `payload` nesting deeper than {@link MAX_DATA_DEPTH}, as its index and
 * depth; `undefined` when every one is within the limit.
 */
export function tooDeepPart(
  payload: Payload | undefined,
): { part: number; depth: number } | undefined {
  for (const [part, { content }] of (payload?.parts ?? []).entries()) {
    if (content.case === "data") {
      const depth = valueDepth(content.value);
      if (depth > MAX_DATA_DEPTH) {
        return { part, depth };
      }
    }
  }
  return undefined;
}

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
 * @throws {DataTooDeepError} when `data` nests deeper than {@link MAX_DATA_DEPTH} levels (the
 * message gives its depth, the limit and where the first level past it begins).
 * @throws {Error} when `data` is not JSON (a number that is not finite, for example).
 */
export function dataPart(data: JsonValue, options: PartOptions = {}): Part {
  const { depth, tooDeepAt } = measure(data);
  if (tooDeepAt !== undefined) {
    throw new DataTooDeepError(depth, tooDeepAt);
  }
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
