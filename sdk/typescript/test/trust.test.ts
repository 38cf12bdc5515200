/**
 * Trust (issue 17) against the real binary over TLS on 127.0.0.1, with certificates and tokens
 * made by `reach certs init` and `reach token`: a Node agent serving TLS registers with its
 * certificate and, called through the router by a TLS client presenting an operator's bearer
 * token, sees the caller the router verified; a peer that is not the router calling the agent
 * directly is refused (only routers may, and the registry may check its health); a plaintext
 * client is refused on the TLS port; an agent with a join token registers.
 */

import assert from "node:assert/strict";
import { writeFileSync } from "node:fs";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";

import {
  AgentRuntime,
  Code,
  MeshClient,
  makePayload,
  partText,
  ReachError,
  Reason,
  readTls,
  RpcChannel,
  type RunningAgent,
  silentLogger,
  textPart,
  type TlsOptions,
} from "@reach-mesh/sdk";
import {
  Health,
  HealthCheckResponse_ServingStatus as ServingStatus,
} from "@reach-mesh/sdk/gen/grpc/health/v1/health_pb.js";
import { AgentService } from "@reach-mesh/sdk/gen/reach/v1/agent_service_pb.js";

import { Mesh, reachBin, run, waitFor, within } from "./support/mesh.js";

const TD = "reach.test";
const AGENT = "echo-ts";
const JOINER = "joiner-ts";

describe("trust: TLS, SPIFFE callers and join tokens", { timeout: 60_000 }, () => {
  let dir: string;
  let pki: string;
  let mesh: Mesh;
  let agent: RunningAgent | undefined;

  const file = (name: string) => join(pki, name);
  const identity = (name: string): TlsOptions => ({
    ca: file("ca.pem"),
    cert: file(`${name}.pem`),
    key: file(`${name}-key.pem`),
  });
  const token = async (...args: string[]) =>
    (
      await run(reachBin(), ["token", ...args, "--key", file("jwt-key.pem"), "--trust-domain", TD])
    ).trim();

  /** An agent of `service` whose `<service>.whoami` answers the caller it was told. */
  const whoami = (service: string, tls: TlsOptions, joinToken?: string) =>
    new AgentRuntime({
      service,
      registry: mesh.endpoint,
      leaseTtlMs: 2000,
      trustDomain: TD,
      tls,
      joinToken,
      logger: silentLogger,
    }).handle({ name: `${service}.whoami`, version: "1.0.0" }, (ctx) =>
      makePayload("whoami", textPart(ctx.caller ?? "nobody")),
    );

  before(async () => {
    dir = await mkdtemp(join(tmpdir(), "reach-ts-trust-"));
    pki = join(dir, "certs");
    await run(reachBin(), [
      "certs",
      "init",
      "--dir",
      pki,
      "--trust-domain",
      TD,
      "--agents",
      AGENT,
      "--operators",
      "admin",
    ]);
    const config = join(dir, "reach.toml");
    writeFileSync(
      config,
      `
[registry]
default_lease_ttl = "2s"
[trust]
trust_domain = "${TD}"

[trust.tls]
cert = "${file("router.pem")}"
key = "${file("router-key.pem")}"
ca = "${file("ca.pem")}"
client_auth = "optional"

[trust.jwt]
keys = ["${file("jwt-public.pem")}"]
`,
    );
    mesh = await Mesh.start({ config, tls: identity("operator-admin") });
  });

  after(async () => {
    await agent?.drain();
    await mesh?.stop();
    await rm(dir, { recursive: true, force: true });
  });

  test("a TLS agent sees the caller the router verified, and answers only routers directly", async () => {
    agent = await whoami(AGENT, identity(`agent-${AGENT}`)).start();
    await waitFor("the TLS agent to be listed", async () =>
      (await mesh.instances(AGENT)).length === 1 ? true : undefined,
    );
    for (const multiplex of [true, false]) {
      const client = new MeshClient({
        source: "ops.script",
        router: mesh.endpoint,
        multiplex,
        tls: { ca: file("ca.pem") },
        token: await token("operator", "--name", "alice", "--ttl", "1h"),
      });
      try {
        const reply = await waitFor("a routed call", () =>
          client.call(`${AGENT}.whoami`, makePayload("whoami"), { timeoutMs: 5000 }),
        );
        const [part] = reply.message.payload?.parts ?? [];
        assert.equal(part && partText(part), `spiffe://${TD}/operator/alice`);
      } finally {
        client.close();
      }
    }

    // A peer that is not the router dialling the agent directly is refused (issue 33): an
    // operator's certificate, another agent's, the registry's (except for health checks).
    const request = {
      message: {
        header: {
          messageId: "0190f0f0-0000-7000-8000-000000000001",
          traceId: "4bf92f3577b34da6a3ce929d0e0e4736",
          target: { case: "capability" as const, value: `${AGENT}.whoami` },
        },
        payload: makePayload("whoami"),
      },
    };
    const claim = { "x-reach-caller": `spiffe://${TD}/operator/root` };
    const notAuthorized = (peer: string) => (error: unknown) => {
      assert.ok(error instanceof ReachError, String(error));
      assert.equal(error.code, Code.PERMISSION_DENIED, error.message);
      assert.equal(error.reason, Reason.NOT_AUTHORIZED);
      assert.equal(error.metadata.identity, peer);
      return true;
    };
    for (const [name, peer] of [
      ["operator-admin", `spiffe://${TD}/operator/admin`],
      [`agent-${AGENT}`, `spiffe://${TD}/agent/${AGENT}`],
      ["registry", `spiffe://${TD}/registry`],
    ] as const) {
      const direct = new RpcChannel(agent.endpoint, 4 * 1024 * 1024, {
        tls: readTls(identity(name), "tls"),
      });
      try {
        await assert.rejects(
          direct.unary(AgentService.method.handle, request, { timeoutMs: 5000, metadata: claim }),
          (error: unknown) => {
            notAuthorized(peer)(error);
            assert.ok(error instanceof ReachError);
            assert.match(error.statusMessage, /spiffe:\/\/reach\.test\/router.*through a router/);
            return true;
          },
        );
        // The multiplexed stream (how routers call agents) is refused as a whole.
        const mux = direct.bidi(AgentService.method.handleMux, { timeoutMs: 5000 });
        const ended = new Promise<unknown>((resolve) => mux.on("error", resolve));
        mux.on("data", () => {});
        notAuthorized(peer)(ReachError.from(await ended));
        const check = direct.unary(
          Health.method.check,
          { service: "reach.v1.AgentService" },
          { timeoutMs: 5000 },
        );
        if (name === "registry") {
          assert.equal((await check).status, ServingStatus.SERVING);
        } else {
          await assert.rejects(check, notAuthorized(peer));
        }
      } finally {
        direct.close();
      }
    }
    // The router's identity is answered, and its x-reach-caller believed.
    const asRouter = new RpcChannel(agent.endpoint, 4 * 1024 * 1024, {
      tls: readTls(identity("router"), "tls"),
    });
    try {
      const response = await asRouter.unary(AgentService.method.handle, request, {
        timeoutMs: 5000,
        metadata: claim,
      });
      const [part] = response.message?.payload?.parts ?? [];
      assert.equal(part && partText(part), `spiffe://${TD}/operator/root`);
    } finally {
      asRouter.close();
    }

    // The agent requires a client certificate of the CA.
    for (const tls of [undefined, readTls({ ca: file("ca.pem") }, "tls")]) {
      const channel = new RpcChannel(agent.endpoint, 4 * 1024 * 1024, { tls });
      try {
        await assert.rejects(
          channel.unary(AgentService.method.handle, {}, { timeoutMs: 3000 }),
          (error: unknown) => error instanceof ReachError && error.code === Code.UNAVAILABLE,
        );
      } finally {
        channel.close();
      }
    }
    await agent.drain();
    agent = undefined;
  });

  test("a plaintext client is refused on the TLS port", async () => {
    const client = new MeshClient({ source: "plain.script", router: mesh.endpoint });
    try {
      await assert.rejects(
        client.call("anything.at.all", makePayload("x"), { timeoutMs: 3000 }),
        (error: unknown) => error instanceof ReachError && error.code === Code.UNAVAILABLE,
      );
    } finally {
      client.close();
    }
  });

  test("a registration its certificate does not allow is refused for good", async () => {
    const other = await whoami("other-ts", identity(`agent-${AGENT}`)).start();
    try {
      const refused = await within(other.registrationRefused(), 10_000, "the refusal");
      assert.equal(refused.code, Code.PERMISSION_DENIED);
    } finally {
      await other.drain();
    }
  });

  test("an agent with a join token registers", async () => {
    // No certificate of its own: it trusts the CA and registers over TLS with the token.
    const joiner = await whoami(
      JOINER,
      { ca: file("ca.pem") },
      await token("join", "--service", JOINER, "--ttl", "1h"),
    ).start();
    try {
      const [instance] = await waitFor("the join-token agent to be listed", async () => {
        const found = await mesh.instances(JOINER);
        return found.length === 1 ? found : undefined;
      });
      assert.equal(instance?.spec?.instanceId, joiner.instanceId);
    } finally {
      await joiner.drain();
    }
  });
});
