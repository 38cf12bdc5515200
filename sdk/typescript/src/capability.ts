/**
 * What an agent declares about a capability when it registers: its version, a description
 * for a person or a model choosing a tool, and the JSON Schemas of the request's and the
 * reply's first data part (served by the registry's `ListCapabilities`).
 *
 * @module
 */

import { create, type JsonValue } from "@bufbuild/protobuf";

import { type Capability, CapabilitySchema } from "./gen/reach/v1/registry_service_pb.js";

/** The most bytes a description may hold (the registry's bound). */
export const MAX_DESCRIPTION_BYTES = 1024;
/** The most bytes of JSON text a schema may hold (the registry's bound). */
export const MAX_SCHEMA_BYTES = 64 * 1024;
/** The deepest a schema may nest objects and arrays (the registry's bound). */
export const MAX_SCHEMA_DEPTH = 32;

/** A capability an agent serves, with what it declares about it. */
export interface CapabilitySpec {
  /** The capability name, dotted (`complaint.classify`). */
  name: string;
  /** The semver version served (`1.2.0`); empty or unset means `0.0.0`. */
  version?: string | undefined;
  /** What it does, when to use it and when not to (at most 1024 bytes of UTF-8). */
  description?: string | undefined;
  /** The JSON Schema (an object or a boolean) of a request's first data part. */
  inputSchema?: JsonValue | undefined;
  /** The JSON Schema (an object or a boolean) of a reply's first data part. */
  outputSchema?: JsonValue | undefined;
}

/**
 * Checks the registry's bounds on `spec` (a description of at most
 * {@link MAX_DESCRIPTION_BYTES} bytes; each schema an object or a boolean of at most
 * {@link MAX_SCHEMA_BYTES} bytes of JSON nesting at most {@link MAX_SCHEMA_DEPTH} deep).
 * That a schema compiles only the registry checks: a refused registration is logged and
 * retried, so check schemas in the agent's own tests.
 *
 * @returns what is wrong, naming the capability and the field; `undefined` when nothing is.
 */
export function checkCapability(spec: CapabilitySpec): string | undefined {
  if (spec.name === "") {
    return 'a capability needs a name (dotted, for example "complaint.classify")';
  }
  const descriptionBytes = Buffer.byteLength(spec.description ?? "", "utf8");
  if (descriptionBytes > MAX_DESCRIPTION_BYTES) {
    return `capability ${JSON.stringify(spec.name)}: the description is ${descriptionBytes} bytes, over the limit of ${MAX_DESCRIPTION_BYTES}`;
  }
  for (const [field, schema] of [
    ["inputSchema", spec.inputSchema],
    ["outputSchema", spec.outputSchema],
  ] as const) {
    if (schema === undefined) {
      continue;
    }
    if (
      typeof schema !== "boolean" &&
      (typeof schema !== "object" || schema === null || Array.isArray(schema))
    ) {
      return `capability ${JSON.stringify(spec.name)}: the ${field} must be a JSON object or a boolean (a JSON Schema)`;
    }
    const size = Buffer.byteLength(JSON.stringify(schema), "utf8");
    if (size > MAX_SCHEMA_BYTES) {
      return `capability ${JSON.stringify(spec.name)}: the ${field} is ${size} bytes of JSON, over the limit of ${MAX_SCHEMA_BYTES}`;
    }
    const levels = depth(schema);
    if (levels > MAX_SCHEMA_DEPTH) {
      return `capability ${JSON.stringify(spec.name)}: the ${field} nests ${levels} levels deep, over the limit of ${MAX_SCHEMA_DEPTH}; flatten it with $defs and $ref`;
    }
  }
  return undefined;
}

/** The registration's `Capability` (schemas as compact JSON text, absent ones empty). */
export function capabilityProto(spec: CapabilitySpec): Capability {
  const text = (schema: JsonValue | undefined) =>
    schema === undefined ? "" : JSON.stringify(schema);
  return create(CapabilitySchema, {
    name: spec.name,
    version: spec.version ?? "",
    description: spec.description ?? "",
    inputSchema: text(spec.inputSchema),
    outputSchema: text(spec.outputSchema),
  });
}

/** How deep `value` nests objects and arrays (a scalar is 0), found iteratively. */
function depth(value: JsonValue): number {
  let deepest = 0;
  const pending: Array<[JsonValue, number]> = [[value, 1]];
  for (let next = pending.pop(); next !== undefined; next = pending.pop()) {
    const [item, level] = next;
    if (typeof item === "object" && item !== null) {
      deepest = Math.max(deepest, level);
      const children = Array.isArray(item) ? item : Object.values(item);
      for (const child of children) {
        pending.push([child, level + 1]);
      }
    }
  }
  return deepest;
}
