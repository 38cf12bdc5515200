/**
 * Trust (the Rust `reach_trust`'s agent and client side): {@link TlsOptions} (the PEM files of
 * a SPIFFE certificate and the mesh CA), the grpc-js credentials made from them, and how an
 * agent tells the caller the router verified (`x-reach-caller`) from a claim anyone could make.
 *
 * @module
 */

import { readFileSync } from "node:fs";

import * as grpc from "@grpc/grpc-js";

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

/**
 * The SPIFFE ID of the connection's client certificate (its URI SAN; grpc-js reports a
 * certificate only once it verified it chains to the CA); `undefined` without one.
 */
export function peerIdentity(call: AuthenticatedCall): string | undefined {
  const names = call.getAuthContext().sslPeerCertificate?.subjectaltname ?? "";
  for (const entry of names.split(", ")) {
    if (entry.startsWith("URI:spiffe://")) {
      return entry.slice("URI:".length);
    }
  }
  return undefined;
}

/**
 * The caller the router vouches for: `value` (the call's `x-reach-caller`) when the
 * connection's peer is `router` (the agent serves TLS), else `undefined` (anyone else could
 * write it).
 */
export function vouchedCaller(
  router: string | undefined,
  peer: string | undefined,
  value: string | undefined,
): string | undefined {
  if (router === undefined || peer !== router || value === undefined) {
    return undefined;
  }
  return /^spiffe:\/\/[^/]+\/[!-~]+$/.test(value) ? value : undefined;
}
