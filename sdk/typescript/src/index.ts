/**
 * The Reach TypeScript SDK: {@link MeshClient} calls capabilities through the router and
 * drives orchestrator tasks; {@link AgentRuntime} serves capabilities as a mesh agent.
 *
 * Layout:
 * - `client` — {@link MeshClient}, {@link MeshStream}, {@link callOptionsWithin}.
 * - `mux` — the client's side of `RouterService.CallMux` (`multiplex: true`).
 * - `runtime` — {@link AgentRuntime}, its options and the handler types; `agent` behind it:
 *   register, heartbeat, serve AgentService (Handle, HandleMux, HandleStream) and health,
 *   bounded concurrency, dedupe, drain.
 * - `parts` — payloads and parts as plain values ({@link dataPart}, {@link firstData}, ...),
 *   nesting at most {@link MAX_DATA_DEPTH} levels.
 * - `errors` — {@link ReachError} and the {@link Reason}s to branch on.
 * - `capability` — the bounds on what a capability declares.
 * - `ids` — trace ids, `traceparent`, UUIDv7 message ids.
 * - `rpc` — {@link RpcChannel}: any generated method (registry, orchestrator) over grpc-js.
 * - `trust` — {@link TlsOptions} (mTLS with SPIFFE certificates), {@link DirectCallers} (an
 *   agent serving TLS answers only routers, and the registry's health checks) and the caller an agent
 *   believes (`HandlerContext.caller`).
 * - `gen` — the generated protobuf-es code (`@reach-mesh/sdk/gen/...`), for everything else.
 *
 * @module
 */

export {
  type CapabilitySpec,
  checkCapability,
  MAX_DESCRIPTION_BYTES,
  MAX_SCHEMA_BYTES,
  MAX_SCHEMA_DEPTH,
} from "./capability.js";
export {
  ACK_PAYLOAD_TYPE,
  ackPayload,
  type CallOptions,
  callOptionsWithin,
  type CallResult,
  MeshClient,
  type MeshClientOptions,
  MeshStream,
  MUX_MAX_MESSAGE_BYTES,
  type StartTaskOptions,
  type StreamRoute,
} from "./client.js";
export {
  Code,
  codeName,
  ERROR_DOMAIN,
  type FieldViolation,
  Reason,
  ReachError,
  type ReachErrorDetails,
  type ReasonName,
} from "./errors.js";
export {
  type CallSettings,
  type ChannelSecurity,
  type Method,
  parseEndpoint,
  RpcChannel,
  serviceDefinition,
} from "./rpc.js";
export {
  CALLER_METADATA,
  DEFAULT_TRUST_DOMAIN,
  DirectCallers,
  readTls,
  type TlsFiles,
  type TlsOptions,
} from "./trust.js";
export { isTraceId, newMessageId, newTraceId, traceparentFor } from "./ids.js";
export { type Logger, silentLogger, stderrLogger } from "./log.js";
export type { JsonObject, JsonValue } from "@bufbuild/protobuf";
export {
  dataDepth,
  dataPart,
  DataTooDeepError,
  firstData,
  firstText,
  jsonOf,
  makePayload,
  MAX_DATA_DEPTH,
  partData,
  type PartOptions,
  partText,
  rawPart,
  textPart,
  urlPart,
  valueOf,
} from "./parts.js";
export {
  AGENT_SERVICE,
  type AgentOptions,
  AgentRuntime,
  type Handler,
  type HandlerContext,
  MAX_REPLY_METADATA_ENTRIES,
  MAX_REPLY_METADATA_KEY_BYTES,
  MAX_REPLY_METADATA_VALUE_BYTES,
  type PayloadInit,
  RunningAgent,
  type StreamHandler,
} from "./runtime.js";
export type { Part, Payload, ReachMessage, Header } from "./gen/reach/v1/envelope_pb.js";
export type { RouteInfo, PublishResponse } from "./gen/reach/v1/router_service_pb.js";
export { type Task, TaskStatus, type HumanWait } from "./gen/reach/v1/orchestrator_service_pb.js";
export { InstanceState } from "./gen/reach/v1/registry_service_pb.js";
