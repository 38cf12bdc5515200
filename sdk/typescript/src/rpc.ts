/**
 * The bridge between protobuf-es (messages and service descriptors generated into `gen/`)
 * and grpc-js (the gRPC-over-HTTP/2 transport): service definitions for a grpc-js server,
 * and a typed client channel whose failures are {@link ReachError}s.
 *
 * @module
 */

import {
  create,
  type DescMessage,
  type DescMethod,
  type DescService,
  fromBinary,
  type MessageInitShape,
  type MessageShape,
  toBinary,
} from "@bufbuild/protobuf";
import * as grpc from "@grpc/grpc-js";

import { ReachError } from "./errors.js";
import { channelCredentials, channelOptions, type TlsFiles } from "./trust.js";

/** A generated method descriptor whose request is `I` and response `O`. */
export type Method<I extends DescMessage, O extends DescMessage> = DescMethod & {
  readonly input: I;
  readonly output: O;
};

/**
 * The grpc-js service definition of `service` (a generated `GenService`): every method's
 * path (`/package.Service/Method`), streaming kind, and protobuf-es binary (de)serialisers.
 */
export function serviceDefinition(service: DescService): grpc.ServiceDefinition {
  const definition: Record<
    string,
    grpc.MethodDefinition<MessageShape<DescMessage>, MessageShape<DescMessage>>
  > = {};
  for (const method of service.methods) {
    const kind = method.methodKind;
    definition[method.localName] = {
      path: `/${service.typeName}/${method.name}`,
      originalName: method.name,
      requestStream: kind === "client_streaming" || kind === "bidi_streaming",
      responseStream: kind === "server_streaming" || kind === "bidi_streaming",
      requestSerialize: (value: MessageShape<DescMessage>) =>
        Buffer.from(toBinary(method.input, value)),
      requestDeserialize: (bytes: Buffer) => fromBinary(method.input, bytes),
      responseSerialize: (value: MessageShape<DescMessage>) =>
        Buffer.from(toBinary(method.output, value)),
      responseDeserialize: (bytes: Buffer) => fromBinary(method.output, bytes),
    };
  }
  return definition;
}

/** Per-call settings. */
export interface CallSettings {
  /** The deadline, in milliseconds from now; sent as `grpc-timeout`. Unset: none. */
  timeoutMs?: number | undefined;
  /** ASCII request metadata (for example `traceparent`). */
  metadata?: Readonly<Record<string, string>> | undefined;
  /** Cancels the call when aborted (the call fails with CANCELLED). */
  signal?: AbortSignal | undefined;
}

/**
 * The grpc-js target and credentials of an endpoint URL: `http://host:port` (plaintext,
 * as `reach dev` serves), `https://host:port` (TLS with the system's roots) or a bare
 * `host:port` (plaintext).
 *
 * @throws {TypeError} for another scheme or a URL without a port.
 */
export function parseEndpoint(endpoint: string): {
  target: string;
  credentials: grpc.ChannelCredentials;
} {
  const bare = !endpoint.includes("://");
  let url: URL;
  try {
    url = new URL(bare ? `http://${endpoint}` : endpoint);
  } catch {
    throw new TypeError(
      `endpoint ${JSON.stringify(endpoint)} is not a URL; write it as http://host:port (for example http://127.0.0.1:7070)`,
    );
  }
  if (url.protocol !== "http:" && url.protocol !== "https:") {
    throw new TypeError(
      `endpoint ${JSON.stringify(endpoint)} has scheme ${url.protocol}; use http:// (plaintext) or https:// (TLS)`,
    );
  }
  if (url.port === "") {
    throw new TypeError(
      `endpoint ${JSON.stringify(endpoint)} has no port; write it as ${url.protocol}//${url.hostname}:PORT`,
    );
  }
  return {
    target: `${url.hostname}:${url.port}`,
    credentials:
      url.protocol === "https:" ? grpc.credentials.createSsl() : grpc.credentials.createInsecure(),
  };
}

/** How an {@link RpcChannel} secures and authenticates its calls. */
export interface ChannelSecurity {
  /**
   * TLS trusting `tls.ca` and presenting `tls.cert` (when set), whatever the endpoint's
   * scheme (Reach writes endpoints `http://` even where the mesh serves TLS).
   */
  tls?: TlsFiles | undefined;
  /** Sent as `authorization: Bearer <token>` on every call. */
  token?: string | undefined;
}

/** A gRPC channel to one endpoint, calling generated methods with protobuf-es messages. */
export class RpcChannel {
  readonly #client: grpc.Client;
  readonly #authorization: string | undefined;

  /**
   * A channel to `endpoint` (see {@link parseEndpoint}) that sends and accepts messages of up
   * to `maxMessageBytes` bytes, secured as `security` says. It connects on the first call and
   * reconnects as needed.
   */
  constructor(endpoint: string, maxMessageBytes: number, security: ChannelSecurity = {}) {
    const parsed = parseEndpoint(endpoint);
    const credentials =
      security.tls === undefined ? parsed.credentials : channelCredentials(security.tls);
    this.#client = new grpc.Client(parsed.target, credentials, {
      "grpc.max_receive_message_length": maxMessageBytes,
      "grpc.max_send_message_length": maxMessageBytes,
      // Reconnects back off from 20 ms to at most 1 s (grpc-js defaults to 1 s growing to
      // 120 s): a registry or router back from an outage is reached within a second.
      "grpc.initial_reconnect_backoff_ms": 20,
      "grpc.max_reconnect_backoff_ms": 1000,
      ...channelOptions(security.tls),
    });
    const token = security.token?.trim();
    this.#authorization = token ? `Bearer ${token}` : undefined;
  }

  /** The call's metadata: `entries`, and the bearer token unless they carry their own. */
  #metadata(entries: Readonly<Record<string, string>> | undefined): grpc.Metadata {
    const metadata = metadataOf(entries);
    if (this.#authorization !== undefined && metadata.get("authorization").length === 0) {
      metadata.set("authorization", this.#authorization);
    }
    return metadata;
  }

  /**
   * Calls the unary `method` with `request`.
   *
   * @throws {ReachError} the peer's status, or the transport's (UNAVAILABLE when the peer
   * cannot be reached, DEADLINE_EXCEEDED when `settings.timeoutMs` passes first, CANCELLED
   * when `settings.signal` aborts).
   */
  unary<I extends DescMessage, O extends DescMessage>(
    method: Method<I, O>,
    request: MessageInitShape<I>,
    settings: CallSettings = {},
  ): Promise<MessageShape<O>> {
    const path = pathOf(method);
    const message = create(method.input, request);
    return new Promise((resolve, reject) => {
      const call = this.#client.makeUnaryRequest<MessageShape<I>, MessageShape<O>>(
        path,
        (value) => Buffer.from(toBinary(method.input, value)),
        (bytes) => fromBinary(method.output, bytes),
        message,
        this.#metadata(settings.metadata),
        callOptionsOf(settings.timeoutMs),
        (error, response) => {
          settings.signal?.removeEventListener("abort", cancel);
          if (error !== null || response === undefined) {
            reject(ReachError.from(error));
          } else {
            resolve(response);
          }
        },
      );
      const cancel = () => call.cancel();
      if (settings.signal?.aborted) {
        call.cancel();
      } else {
        settings.signal?.addEventListener("abort", cancel, { once: true });
      }
    });
  }

  /**
   * Opens the bidirectional `method`. Write requests to the returned stream, end it to
   * half-close, read responses from it; a failure is emitted as an `error` event whose
   * status {@link ReachError.from} decodes.
   */
  bidi<I extends DescMessage, O extends DescMessage>(
    method: Method<I, O>,
    settings: CallSettings = {},
  ): grpc.ClientDuplexStream<MessageShape<I>, MessageShape<O>> {
    const call = this.#client.makeBidiStreamRequest<MessageShape<I>, MessageShape<O>>(
      pathOf(method),
      (value) => Buffer.from(toBinary(method.input, value)),
      (bytes) => fromBinary(method.output, bytes),
      this.#metadata(settings.metadata),
      callOptionsOf(settings.timeoutMs),
    );
    if (settings.signal !== undefined) {
      const cancel = () => call.cancel();
      if (settings.signal.aborted) {
        call.cancel();
      } else {
        settings.signal.addEventListener("abort", cancel, { once: true });
        call.once("close", () => settings.signal?.removeEventListener("abort", cancel));
      }
    }
    return call;
  }

  /** Closes the channel; calls in flight fail with UNAVAILABLE or CANCELLED. */
  close(): void {
    this.#client.close();
  }
}

function pathOf(method: DescMethod): string {
  return `/${method.parent.typeName}/${method.name}`;
}

function metadataOf(entries: Readonly<Record<string, string>> | undefined): grpc.Metadata {
  const metadata = new grpc.Metadata();
  for (const [key, value] of Object.entries(entries ?? {})) {
    metadata.set(key, value);
  }
  return metadata;
}

function callOptionsOf(timeoutMs: number | undefined): grpc.CallOptions {
  return timeoutMs === undefined ? {} : { deadline: Date.now() + Math.max(0, timeoutMs) };
}
