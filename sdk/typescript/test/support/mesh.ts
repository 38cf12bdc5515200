/**
 * Test support: a real `reach dev` process on a free 127.0.0.1 port (registry, router and
 * orchestrator in one; optionally the Rust example agents), bounded waits on conditions, and
 * the paths the tests need. `REACH_BIN` names the binary (default `<repo>/target/debug/reach`).
 */

import { type ChildProcess, execFile, spawn } from "node:child_process";
import { existsSync } from "node:fs";
import { mkdtemp, rm } from "node:fs/promises";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

import { readTls, RpcChannel, type TlsOptions } from "@reach-mesh/sdk";
import {
  Health,
  HealthCheckResponse_ServingStatus,
} from "@reach-mesh/sdk/gen/grpc/health/v1/health_pb.js";
import {
  type Instance,
  InstanceState,
  RegistryService,
} from "@reach-mesh/sdk/gen/reach/v1/registry_service_pb.js";

/** `sdk/typescript` (this file runs as `build/test/support/mesh.js`). */
export const sdkDir = resolve(dirname(fileURLToPath(import.meta.url)), "../../..");
/** The repository root. */
export const repoRoot = resolve(sdkDir, "../..");

/** The `reach` binary the tests run. */
export function reachBin(): string {
  const bin = process.env.REACH_BIN ?? join(repoRoot, "target/debug/reach");
  if (!existsSync(bin)) {
    throw new Error(
      `the reach binary ${bin} does not exist: build it (cargo build -p reach) or set REACH_BIN`,
    );
  }
  return bin;
}

/**
 * Polls `condition` every `intervalMs` until it returns a value other than `undefined` or
 * `false`, and resolves to it; rejects after `timeoutMs` naming `what` and the last error.
 */
export async function waitFor<T>(
  what: string,
  condition: () => Promise<T | undefined | false> | T | undefined | false,
  { timeoutMs = 10_000, intervalMs = 20 }: { timeoutMs?: number; intervalMs?: number } = {},
): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  let last: unknown;
  for (;;) {
    try {
      const value = await condition();
      if (value !== undefined && value !== false) {
        return value;
      }
    } catch (error) {
      last = error;
    }
    if (Date.now() >= deadline) {
      const why =
        last === undefined
          ? ""
          : `; last error: ${last instanceof Error ? last.message : String(last)}`;
      throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}${why}`);
    }
    await new Promise((done) => setTimeout(done, intervalMs));
  }
}

/**
 * Runs `command` with `args` (and `env` on top of this process's), within 30 s; resolves to
 * its stdout, rejects with its exit status and output when it fails.
 */
export function run(
  command: string,
  args: string[],
  env: Record<string, string> = {},
): Promise<string> {
  return new Promise((done, fail) => {
    execFile(
      command,
      args,
      { env: { ...process.env, ...env }, timeout: 30_000 },
      (error, stdout, stderr) => {
        if (error !== null) {
          fail(
            new Error(`${command} ${args.join(" ")} failed (${error.message}): ${stdout}${stderr}`),
          );
        } else {
          done(stdout);
        }
      },
    );
  });
}

/** `promise`, or a rejection naming `what` when it takes longer than `timeoutMs`. */
export async function within<T>(promise: Promise<T>, timeoutMs: number, what: string): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  const late = new Promise<never>((_, reject) => {
    timer = setTimeout(
      () => reject(new Error(`timed out after ${timeoutMs} ms waiting for ${what}`)),
      timeoutMs,
    );
  });
  try {
    return await Promise.race([promise, late]);
  } finally {
    clearTimeout(timer);
  }
}

/** A port that was free a moment ago on 127.0.0.1. */
export function freePort(): Promise<number> {
  return new Promise((resolvePort, reject) => {
    const server = createServer();
    server.once("error", reject);
    server.listen(0, "127.0.0.1", () => {
      const address = server.address();
      const port = typeof address === "object" && address !== null ? address.port : 0;
      server.close(() => resolvePort(port));
    });
  });
}

/** A running `reach dev`. */
export class Mesh {
  #process: ChildProcess;
  readonly #dataDir: string;
  readonly #args: string[];
  readonly #env: Record<string, string>;
  readonly #output: string[] = [];
  /** The gRPC endpoint of registry, router and orchestrator: `http://127.0.0.1:PORT`. */
  readonly endpoint: string;
  /** A channel to the registry, for the tests' own queries. */
  readonly registry: RpcChannel;

  private constructor(
    args: string[],
    env: Record<string, string>,
    dataDir: string,
    endpoint: string,
    tls: TlsOptions | undefined,
  ) {
    this.#args = args;
    this.#env = env;
    this.#dataDir = dataDir;
    this.endpoint = endpoint;
    this.registry = new RpcChannel(endpoint, 16 * 1024 * 1024, {
      tls: tls === undefined ? undefined : readTls(tls, "tls"),
    });
    this.#process = this.#spawn();
  }

  #spawn(): ChildProcess {
    const child = spawn(reachBin(), this.#args, {
      cwd: repoRoot,
      env: { ...process.env, REACH_LOG: "warn", ...this.#env },
      stdio: ["ignore", "pipe", "pipe"],
    });
    const keep = (chunk: Buffer) => {
      this.#output.push(chunk.toString());
      if (this.#output.length > 200) {
        this.#output.shift();
      }
    };
    child.stdout?.on("data", keep);
    child.stderr?.on("data", keep);
    return child;
  }

  /** Resolves once `reach dev` serves (health SERVING); rejects if it exits first. */
  async #serving(): Promise<void> {
    await waitFor("reach dev to serve", async () => {
      if (this.#process.exitCode !== null) {
        throw new Error(`reach dev exited with ${this.#process.exitCode}: ${this.output()}`);
      }
      const health = await this.registry.unary(
        Health.method.check,
        { service: "" },
        { timeoutMs: 500 },
      );
      return health.status === HealthCheckResponse_ServingStatus.SERVING;
    });
  }

  /**
   * Starts `reach dev` (with the example agents when `agents`) with extra `env` settings and
   * a `config` file, and resolves once it serves (and, with agents, once the coordinator is
   * READY). With `tls` (a mesh serving TLS) the tests' own queries go over TLS with it.
   */
  static async start({
    agents = false,
    env = {},
    config,
    tls,
  }: {
    agents?: boolean;
    env?: Record<string, string>;
    config?: string;
    tls?: TlsOptions;
  } = {}): Promise<Mesh> {
    reachBin();
    const dataDir = await mkdtemp(join(tmpdir(), "reach-ts-test-"));
    const port = await freePort();
    const args = [
      "dev",
      "--listen",
      `127.0.0.1:${port}`,
      "--admin-listen",
      "",
      "--edge-listen",
      "",
      "--data-dir",
      dataDir,
    ];
    if (!agents) {
      args.push("--no-agents");
    }
    if (config !== undefined) {
      args.push("--config", config);
    }
    const mesh = new Mesh(args, env, dataDir, `http://127.0.0.1:${port}`, tls);
    try {
      await mesh.#serving();
      if (agents) {
        await mesh.waitForState("coordinator-1", InstanceState.READY);
      }
    } catch (error) {
      await mesh.stop();
      throw error;
    }
    return mesh;
  }

  /** The registry's instances (of `service`, if given). */
  async instances(service = ""): Promise<Instance[]> {
    const list = await this.registry.unary(
      RegistryService.method.listInstances,
      { service },
      { timeoutMs: 2000 },
    );
    return list.instances;
  }

  /** The instance `instanceId` as the registry sees it; `undefined` when it is not registered. */
  async instance(instanceId: string): Promise<Instance | undefined> {
    return (await this.instances()).find((i) => i.spec?.instanceId === instanceId);
  }

  /** Waits until the registry reports `instanceId` in `state`; resolves to the instance. */
  waitForState(instanceId: string, state: InstanceState, timeoutMs = 10_000): Promise<Instance> {
    return waitFor(
      `instance ${instanceId} to be ${InstanceState[state]}`,
      async () => {
        const found = await this.instance(instanceId);
        return found?.state === state ? found : undefined;
      },
      { timeoutMs },
    );
  }

  /** Waits until `instanceId` is gone from the registry. */
  waitForGone(instanceId: string, timeoutMs = 10_000): Promise<true> {
    return waitFor(
      `instance ${instanceId} to leave the registry`,
      async () => (await this.instance(instanceId)) === undefined,
      {
        timeoutMs,
      },
    );
  }

  /** What `reach dev` printed last (for failure messages). */
  output(): string {
    return this.#output.join("");
  }

  /**
   * Restarts `reach dev` on the same port: its registry comes back empty, so every agent's
   * next heartbeat finds its lease unknown.
   */
  async restart(): Promise<void> {
    await this.#terminate();
    this.#process = this.#spawn();
    await this.#serving();
  }

  /** Stops `reach dev` (SIGTERM, SIGKILL after 5 s) and removes its data directory. */
  async stop(): Promise<void> {
    this.registry.close();
    await this.#terminate();
    await rm(this.#dataDir, { recursive: true, force: true });
  }

  async #terminate(): Promise<void> {
    const child = this.#process;
    if (child.exitCode === null && child.signalCode === null) {
      const exited = new Promise<void>((done) => child.once("exit", () => done()));
      child.kill("SIGTERM");
      const killer = setTimeout(() => child.kill("SIGKILL"), 5000);
      await exited;
      clearTimeout(killer);
    }
  }
}
