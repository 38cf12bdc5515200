/**
 * Trust (issue 17) against the real binary over TLS on 127.0.0.1, with certificates and tokens
 * made by `reach certs init` and `reach token`: a Node agent serving TLS registers with its
 * certificate and, called through the router by a TLS client presenting an operator's bearer
 * token, sees the caller the router verified; a forged `x-reach-caller` from a peer that is not
 * the router is not believed; a plaintext client is refused on the TLS port; an agent with a
 * join token registers.
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
  readTls,
  RpcChannel,
  type RunningAgent,
  silentLogger,
  textPart,
  type TlsOptions,
} from "@reach-mesh/sdk";
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

  test("a TLS agent sees the caller the router verified, and nobody else's claim", async () => {
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

    // A peer that is not the router (an operator's certificate) dialling the agent directly
    // cannot claim a caller.
    const direct = new RpcChannel(agent.endpoint, 4 * 1024 * 1024, {
      tls: readTls(identity("operator-admin"), "tls"),
    });
    try {
      const response = await direct.unary(
        AgentService.method.handle,
        {
          message: {
            header: {
              messageId: "0190f0f0-0000-7000-8000-000000000001",
              traceId: "4bf92f3577b34da6a3ce929d0e0e4736",
              target: { case: "capability", value: `${AGENT}.whoami` },
            },
            payload: makePayload("whoami"),
          },
        },
        { timeoutMs: 5000, metadata: { "x-reach-caller": `spiffe://${TD}/operator/root` } },
      );
      const [part] = response.message?.payload?.parts ?? [];
      assert.equal(part && partText(part), "nobody");
    } finally {
      direct.close();
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
