/**
 * Trust (the Rust `reach_trust`'s agent and client side): {@link TlsOptions} (the PEM files of
 * a SPIFFE certificate and the mesh CA), the grpc-js credentials made from them, and how an
 * agent tells the caller the router verified (`x-reach-caller`) from a claim anyone could make.
 *
 * @module
 */

import { readFileSync } from "node:fs";

import * as grpc from "@grpc/grpc-js";

import { Code, ReachError, Reason } from "./errors.js";

/** The trust domain when none is configured (`reach_trust::DEFAULT_TRUST_DOMAIN`). */
export const DEFAULT_TRUST_DOMAIN = "reach.local";
/** The metadata key the router names a call's verified caller in. */
export const CALLER_METADATA = "x-reach-caller";

/** PEM files for TLS, as `reach certs init` writes them. */
export interface TlsOptions {
  /** The mesh CA certificate (`certs/ca.pem`): peers must chain to it. */
  ca: string;
  /**
   * This side's certificate chain (`certs/agent-<service>.pem`): an agent serves TLS with it
   * and presents it to the registry. Without one a side authenticates with a bearer token,
   * where the mesh allows callers without a certificate (`client_auth = "optional"`).
   */
  cert?: string | undefined;
  /** The certificate's private key (`certs/agent-<service>-key.pem`). */
  key?: string | undefined;
  /**
   * The name the server's certificate must carry, instead of the host of the endpoint
   * dialled. Certificates of `reach certs init` name `localhost` and `127.0.0.1` (plus any
   * `--host`); set this (for example `"localhost"`) to reach the mesh at an address its
   * certificate does not name. Default: the endpoint's host.
   */
  serverName?: string | undefined;
}

/** The PEM contents of {@link TlsOptions}, read once. */
export interface TlsFiles {
  ca: Buffer;
  cert: Buffer | undefined;
  key: Buffer | undefined;
  serverName: string | undefined;
}

/**
 * Reads the files of `tls`.
 *
 * @throws {TypeError} naming the setting (`where` is its prefix, e.g. `tls`) when a file cannot
 * be read, or `cert` and `key` are not both set or both unset.
 */
export function readTls(tls: TlsOptions, where: string): TlsFiles {
  if ((tls.cert === undefined) !== (tls.key === undefined)) {
    throw new TypeError(`${where}.cert and ${where}.key go together: set both or neither`);
  }
  const read = (name: "ca" | "cert" | "key"): Buffer | undefined => {
    const path = tls[name];
    if (path === undefined) {
      return undefined;
    }
    try {
      return readFileSync(path);
    } catch (error) {
      throw new TypeError(
        `${where}.${name}: ${JSON.stringify(path)} cannot be read: ${error instanceof Error ? error.message : String(error)}`,
      );
    }
  };
  if (!tls.ca) {
    throw new TypeError(`${where}.ca must be set: the mesh CA certificate (certs/ca.pem)`);
  }
  return { ca: read("ca")!, cert: read("cert"), key: read("key"), serverName: tls.serverName };
}

/** Channel credentials that trust the CA and present the certificate (when set). */
export function channelCredentials(files: TlsFiles): grpc.ChannelCredentials {
  return grpc.credentials.createSsl(files.ca, files.key ?? null, files.cert ?? null);
}

/** Channel options of the TLS settings (the server name override). */
export function channelOptions(files: TlsFiles | undefined): grpc.ChannelOptions {
  return files?.serverName ? { "grpc.ssl_target_name_override": files.serverName } : {};
}

/** Server credentials serving the certificate and requiring client certificates of the CA. */
export function serverCredentials(files: TlsFiles): grpc.ServerCredentials {
  if (files.cert === undefined || files.key === undefined) {
    throw new TypeError("serving TLS needs a certificate and key");
  }
  return grpc.ServerCredentials.createSsl(
    files.ca,
    [{ cert_chain: files.cert, private_key: files.key }],
    true,
  );
}

/** The router's SPIFFE ID in `trustDomain`. */
export function routerIdentity(trustDomain: string): string {
  return `spiffe://${trustDomain}/router`;
}

/** A server call (unary or streaming): what {@link peerIdentity} reads. */
export interface AuthenticatedCall {
  getAuthContext(): { sslPeerCertificate?: { subjectaltname?: string } | undefined };
}

/** The registry's SPIFFE ID in `trustDomain`. */
export function registryIdentity(trustDomain: string): string {
  return `spiffe://${trustDomain}/registry`;
}

/** Whether `value` is a SPIFFE ID (`spiffe://<domain>/<path>`, printable ASCII). */
function isSpiffeId(value: string): boolean {
  return /^spiffe:\/\/[a-z0-9._-]+\/[!-~]+$/.test(value);
}

/**
 * The SPIFFE ID of the connection's client certificate: its one URI SAN (the X.509-SVID rule;
 * grpc-js reports a certificate only once it verified it chains to the CA; host names play no
 * part). `undefined` without one, or when the certificate carries no URI SAN, several, or one
 * that is not a SPIFFE ID.
 */
export function peerIdentity(call: AuthenticatedCall): string | undefined {
  const names = call.getAuthContext().sslPeerCertificate?.subjectaltname ?? "";
  const uris = names.split(", ").filter((entry) => entry.startsWith("URI:"));
  if (uris.length !== 1) {
    return undefined;
  }
  const uri = uris[0]!.slice("URI:".length);
  return isSpiffeId(uri) ? uri : undefined;
}

/** The method path prefix of health checks. */
const HEALTH_PREFIX = "/grpc.health.v1.Health/";
/** The most characters of a refused method path a refusal repeats. */
const MAX_PATH_ECHOED = 128;

/**
 * Who may call an agent's port directly when it serves TLS (as the Rust SDK's
 * `reach_sdk::DirectCallers`): the router identities may call everything (AgentService,
 * health), the probe identities (the registry) only `grpc.health.v1`; anyone else is refused
 * PERMISSION_DENIED with ErrorInfo `NOT_AUTHORIZED`, so the router's call policy cannot be
 * skipped by dialling the agent. The peer is judged by its certificate's SPIFFE ID, once per
 * RPC (a multiplexed stream, how routers call agents, is one RPC).
 */
export class DirectCallers {
  /** SPIFFE IDs that may call everything; their `x-reach-caller` is believed. */
  readonly routers: readonly string[];
  /** SPIFFE IDs that may call `grpc.health.v1` besides the routers. */
  readonly probes: readonly string[];

  private constructor(routers: readonly string[], probes: readonly string[]) {
    this.routers = routers;
    this.probes = probes;
  }

  /**
   * From the agent options: `routers` and `probes` as SPIFFE IDs of `trustDomain`, each empty
   * meaning its default (`spiffe://<trustDomain>/router`, `spiffe://<trustDomain>/registry`).
   *
   * @throws {TypeError} naming the option whose value is not a SPIFFE ID of the trust domain.
   */
  static of(
    trustDomain: string,
    routers: readonly string[] = [],
    probes: readonly string[] = [],
  ): DirectCallers {
    const parse = (option: string, values: readonly string[], fallback: string): string[] => {
      if (values.length === 0) {
        return [fallback];
      }
      for (const value of values) {
        if (!isSpiffeId(value)) {
          throw new TypeError(
            `${option}: ${JSON.stringify(value)} is not a SPIFFE ID; give one like ${fallback}`,
          );
        }
        if (value.slice("spiffe://".length).split("/")[0] !== trustDomain) {
          throw new TypeError(
            `${option}: ${JSON.stringify(value)} is not of the agent's trust domain ${JSON.stringify(trustDomain)}; peers of other trust domains never get past the TLS handshake`,
          );
        }
      }
      return [...values];
    };
    return new DirectCallers(
      parse("routerIdentities", routers, routerIdentity(trustDomain)),
      parse("probeIdentities", probes, registryIdentity(trustDomain)),
    );
  }

  /** Whether `peer` is one of the router identities. */
  isRouter(peer: string | undefined): boolean {
    return peer !== undefined && this.routers.includes(peer);
  }

  /**
   * Why `peer` (its SPIFFE ID; `undefined`: no certificate) may not call `path`
   * (`/package.Service/Method`), or `undefined` when it may.
   */
  refusal(path: string, peer: string | undefined): ReachError | undefined {
    if (this.isRouter(peer)) {
      return undefined;
    }
    const health = path.startsWith(HEALTH_PREFIX);
    if (health && peer !== undefined && this.probes.includes(peer)) {
      return undefined;
    }
    const routers = this.routers.join(", ");
    const reason = health
      ? `an agent's health is checked only by the registry (${this.probes.join(", ")}) and the routers (${routers}); ask the registry (\`reach agents\`) how an instance is doing`
      : `an agent answers only the mesh's routers (${routers}), so that the call policy cannot be skipped; send the call through a router (reach.v1.RouterService), or add the identity to the agent's routerIdentities if it is a router`;
    const identity = peer ?? "anonymous";
    const target = `${path.slice(0, MAX_PATH_ECHOED)} on this agent directly`;
    return ReachError.of(
      Code.PERMISSION_DENIED,
      `${identity} may not call ${target}: ${reason}`,
      Reason.NOT_AUTHORIZED,
      { identity, action: "call", target },
    );
  }

  /**
   * `implementation` of `definition` with every method refusing (before it runs) the calls
   * {@link DirectCallers.refusal} refuses; `onRefused` hears of each (the audit log).
   */
  guard(
    definition: grpc.ServiceDefinition,
    implementation: grpc.UntypedServiceImplementation,
    onRefused: (refusal: ReachError) => void,
  ): grpc.UntypedServiceImplementation {
    const guarded: grpc.UntypedServiceImplementation = {};
    for (const [name, handler] of Object.entries(implementation)) {
      const method = definition[name];
      if (method === undefined) {
        // Fail closed: a handler the check cannot place would be served unchecked.
        throw new TypeError(`the service definition has no method ${JSON.stringify(name)}`);
      }
      const path = method.path;
      const refused = (call: AuthenticatedCall): Partial<grpc.StatusObject> | undefined => {
        const refusal = this.refusal(path, peerIdentity(call));
        if (refusal === undefined) {
          return undefined;
        }
        onRefused(refusal);
        return refusal.toGrpcStatus();
      };
      if (method.responseStream) {
        const inner = handler as (call: grpc.ServerWritableStream<unknown, unknown>) => void;
        guarded[name] = ((call: grpc.ServerWritableStream<unknown, unknown>) => {
          const status = refused(call);
          if (status === undefined) {
            inner(call);
          } else {
            call.emit("error", status);
          }
        }) as grpc.UntypedHandleCall;
      } else {
        const inner = handler as (
          call: grpc.ServerUnaryCall<unknown, unknown>,
          callback: grpc.sendUnaryData<unknown>,
        ) => void;
        guarded[name] = ((
          call: grpc.ServerUnaryCall<unknown, unknown>,
          callback: grpc.sendUnaryData<unknown>,
        ) => {
          const status = refused(call);
          if (status === undefined) {
            inner(call, callback);
          } else {
            callback(status, null);
          }
        }) as grpc.UntypedHandleCall;
      }
    }
    return guarded;
  }
}

/**
 * The caller the router vouches for: `value` (the call's `x-reach-caller`) when the
 * connection's peer is one of the router identities of `callers` (the agent serves TLS), else
 * `undefined` (anyone else could write it).
 */
export function vouchedCaller(
  callers: DirectCallers | undefined,
  peer: string | undefined,
  value: string | undefined,
): string | undefined {
  if (callers === undefined || !callers.isRouter(peer) || value === undefined) {
    return undefined;
  }
  return /^spiffe:\/\/[^/]+\/[!-~]+$/.test(value) ? value : undefined;
}
