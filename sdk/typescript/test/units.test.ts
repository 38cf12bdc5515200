/**
 * The SDK's pure parts, without a mesh: ids, parts, error details, capability bounds and the
 * dedupe memory.
 */

import assert from "node:assert/strict";
import { describe, test } from "node:test";

import type { JsonValue } from "@reach-mesh/sdk";
import {
  AgentRuntime,
  checkCapability,
  Code,
  dataDepth,
  dataPart,
  DataTooDeepError,
  firstData,
  isTraceId,
  makePayload,
  MAX_DATA_DEPTH,
  newMessageId,
  newTraceId,
  partData,
  Reason,
  ReachError,
  readTls,
  textPart,
  traceparentFor,
} from "@reach-mesh/sdk";

import { DedupeCache } from "../src/dedupe.js";
import { DirectCallers, peerIdentity, vouchedCaller } from "../src/trust.js";

describe("ids", () => {
  test("trace ids and traceparent follow W3C Trace Context", () => {
    const traceId = newTraceId();
    assert.ok(isTraceId(traceId), traceId);
    assert.ok(!isTraceId("0".repeat(32)), "all zeros is invalid");
    assert.ok(!isTraceId(traceId.toUpperCase()), "upper case is invalid");
    assert.match(traceparentFor(traceId), new RegExp(`^00-${traceId}-[0-9a-f]{16}-01$`));
    assert.throws(() => traceparentFor("nope"), RangeError);
  });

  test("message ids are UUIDv7 and sort by creation time", async () => {
    const first = newMessageId();
    await new Promise((done) => setTimeout(done, 2));
    const second = newMessageId();
    assert.match(first, /^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$/);
    assert.ok(first < second);
    const ms = Number.parseInt(first.replace(/-/g, "").slice(0, 12), 16);
    assert.ok(Math.abs(ms - Date.now()) < 1000, "the first 48 bits are the time in ms");
  });
});

describe("parts", () => {
  test("a data part round-trips a plain object; other parts read as undefined", () => {
    const data = { complaint_id: "1", nested: { list: [1, "two", null, true] } };
    const payload = makePayload("t", textPart("hi"), dataPart(data));
    assert.deepEqual(firstData(payload), data);
    assert.equal(partData(payload.parts[0]!), undefined);
    assert.equal(payload.parts[1]?.mediaType, "application/json");
    assert.equal(
      firstData(makePayload("t", dataPart([1, 2]))),
      undefined,
      "an array is not an object",
    );
  });
});

describe("data depth", () => {
  test("a data part nests at most MAX_DATA_DEPTH levels, each object or array one", () => {
    assert.equal(MAX_DATA_DEPTH, 31);
    const depths = [1, "x", null, [], {}, { a: [1] }, [[1], [[2]]]].map((v) => dataDepth(v));
    assert.deepEqual(depths, [0, 0, 0, 1, 1, 2, 3]);
    let atLimit: JsonValue = 1;
    for (let level = 0; level < MAX_DATA_DEPTH; level += 1) {
      atLimit = level % 2 === 0 ? [atLimit] : { a: atLimit };
    }
    assert.equal(dataDepth(atLimit), MAX_DATA_DEPTH);
    assert.deepEqual(partData(dataPart(atLimit)), atLimit);

    assert.throws(
      () => dataPart({ ok: 1, deep: [[atLimit]] }),
      (error: unknown) => {
        assert.ok(error instanceof DataTooDeepError && error instanceof TypeError);
        assert.equal(error.depth, MAX_DATA_DEPTH + 3);
        assert.equal(error.limit, MAX_DATA_DEPTH);
        // Where the first level past the limit begins: 31 steps below $.
        assert.ok(error.path.startsWith("$.deep[0][0][0].a[0]"), error.path);
        assert.equal(error.path.match(/\.\w+|\[\d+\]/g)?.length, MAX_DATA_DEPTH);
        assert.match(error.message, /nests 34 levels deep, over the limit of 31/);
        return true;
      },
    );

    // Any depth is measured without recursion, and refused.
    let veryDeep: JsonValue = 1;
    for (let level = 0; level < 100_000; level += 1) {
      veryDeep = [veryDeep];
    }
    assert.equal(dataDepth(veryDeep), 100_000);
    assert.throws(() => dataPart(veryDeep), /nests 100000 levels deep/);
  });
});

describe("ReachError", () => {
  test("encodes and decodes ErrorInfo, RetryInfo and BadRequest as google.rpc.Status", () => {
    const error = new ReachError(Code.UNAVAILABLE, "try later", {
      reason: Reason.OVERLOADED,
      metadata: { route: "capability x" },
      retryAfterMs: 50,
      violations: [{ field: "input/category", description: "must be one of ..." }],
    });
    const decoded = ReachError.fromStatus(Code.UNAVAILABLE, "try later", error.encodeStatus());
    assert.equal(decoded.reason, "OVERLOADED");
    assert.equal(decoded.domain, "reach.dev");
    assert.deepEqual(decoded.metadata, { route: "capability x" });
    assert.equal(decoded.retryAfterMs, 50);
    assert.deepEqual(decoded.violations, [
      { field: "input/category", description: "must be one of ..." },
    ]);
    assert.equal(decoded.message, "UNAVAILABLE [OVERLOADED]: try later");
    assert.equal(
      ReachError.fromStatus(Code.INTERNAL, "x", new Uint8Array([0xff, 0xff])).reason,
      undefined,
    );
    assert.equal(ReachError.from(new Error("boom")).code, Code.UNKNOWN);
  });
});

describe("capability bounds", () => {
  test("the registry's bounds are checked before registering", () => {
    assert.equal(checkCapability({ name: "x", version: "1.0.0", inputSchema: {} }), undefined);
    assert.match(checkCapability({ name: "x", description: "d".repeat(1025) }) ?? "", /1025 bytes/);
    assert.match(
      checkCapability({ name: "x", outputSchema: [] }) ?? "",
      /outputSchema must be a JSON object or a boolean/,
    );
    let deep: object = {};
    for (let i = 0; i < 32; i++) {
      deep = { not: deep };
    }
    assert.match(checkCapability({ name: "x", inputSchema: deep as never }) ?? "", /33 levels/);
  });
});

describe("DedupeCache", () => {
  test("repeats share an outcome until the window passes; duplicates wait for the first run", async () => {
    let now = 0;
    const cache = new DedupeCache<string>(10_000, 100, 1 << 20, () => now);
    let runs = 0;
    let open: () => void = () => {};
    const gate = new Promise<void>((resolve) => (open = resolve));
    const run = async () => {
      runs += 1;
      await gate;
      return `outcome ${runs}`;
    };
    const first = cache.once("a", run, () => 1);
    const duplicate = cache.once("a", run, () => 1);
    open();
    assert.deepEqual(await Promise.all([first, duplicate]), ["outcome 1", "outcome 1"]);
    assert.equal(await cache.once("a", run, () => 1), "outcome 1");
    now = 10_001;
    assert.equal(await cache.once("a", run, () => 1), "outcome 2", "forgotten after the window");
  });

  test("an unhandled run is not remembered; capacity and bytes bound the memory", async () => {
    const cache = new DedupeCache<string>(60_000, 3, 10_000);
    assert.equal(
      await cache.once(
        "x",
        async () => undefined,
        () => 0,
      ),
      undefined,
    );
    assert.equal(
      await cache.once(
        "x",
        async () => "ran",
        () => 0,
      ),
      "ran",
      "the next caller runs it",
    );
    for (const id of ["a", "b", "c", "d"]) {
      await cache.once(
        id,
        async () => id,
        () => 4000,
      );
    }
    assert.ok(cache.size <= 3, String(cache.size));
    assert.ok(cache.bytes <= 10_000, String(cache.bytes));
    assert.equal(
      await cache.once(
        "d",
        async () => "again",
        () => 0,
      ),
      "d",
      "the newest is kept",
    );
  });
});

describe("trust", () => {
  const router = "spiffe://reach.test/router";
  const alice = "spiffe://reach.test/operator/alice";

  test("x-reach-caller is believed only from the router's certificate", () => {
    const callers = DirectCallers.of("reach.test");
    assert.equal(vouchedCaller(callers, router, alice), alice);
    assert.equal(vouchedCaller(callers, "spiffe://reach.test/agent/other", alice), undefined);
    assert.equal(vouchedCaller(callers, undefined, alice), undefined, "a plaintext peer");
    assert.equal(vouchedCaller(undefined, router, alice), undefined, "an agent not serving TLS");
    assert.equal(vouchedCaller(callers, router, undefined), undefined, "no caller named");
    assert.equal(vouchedCaller(callers, router, "alice"), undefined, "not a SPIFFE ID");
  });

  test("an agent serving TLS answers only routers, and health checks of the registry", () => {
    const callers = DirectCallers.of("reach.test");
    const registry = "spiffe://reach.test/registry";
    const handle = "/reach.v1.AgentService/Handle";
    const health = "/grpc.health.v1.Health/Check";
    for (const path of [handle, health, "/reach.v1.AgentService/HandleMux"]) {
      assert.equal(callers.refusal(path, router), undefined, path);
    }
    assert.equal(callers.refusal(health, registry), undefined);
    for (const peer of [registry, "spiffe://reach.test/agent/other", alice, undefined]) {
      for (const path of peer === registry ? [handle] : [handle, health]) {
        const refusal = callers.refusal(path, peer);
        assert.ok(refusal !== undefined, `${path} ${peer}`);
        assert.equal(refusal.code, Code.PERMISSION_DENIED);
        assert.equal(refusal.reason, Reason.NOT_AUTHORIZED);
        assert.equal(refusal.metadata.identity, peer ?? "anonymous");
        assert.ok(refusal.statusMessage.includes(router), refusal.statusMessage);
      }
    }
    const custom = DirectCallers.of("reach.test", ["spiffe://reach.test/router-eu"]);
    assert.equal(custom.refusal(handle, "spiffe://reach.test/router-eu"), undefined);
    assert.notEqual(custom.refusal(handle, router), undefined);
    assert.throws(
      () => DirectCallers.of("reach.test", ["router"]),
      /routerIdentities: .*not a SPIFFE ID/,
    );
    // A handler the check cannot place (no such method in the definition) is refused, not
    // served unchecked.
    assert.throws(() => callers.guard({}, { handle: () => {} }, () => {}), /no method "handle"/);
    assert.throws(
      () => DirectCallers.of("reach.test", [], ["spiffe://elsewhere/registry"]),
      /probeIdentities: .*trust domain/,
    );
  });

  test("the peer's SPIFFE ID is its certificate's URI SAN", () => {
    const call = (subjectaltname?: string) => ({
      getAuthContext: () =>
        subjectaltname === undefined ? {} : { sslPeerCertificate: { subjectaltname } },
    });
    assert.equal(peerIdentity(call(`URI:${router}, DNS:localhost, IP Address:127.0.0.1`)), router);
    assert.equal(peerIdentity(call("DNS:localhost, IP Address:127.0.0.1")), undefined);
    assert.equal(peerIdentity(call()), undefined);
    // Exactly one URI SAN, and a SPIFFE ID (the X.509-SVID rule).
    assert.equal(peerIdentity(call(`URI:${router}, URI:spiffe://reach.test/agent/x`)), undefined);
    assert.equal(peerIdentity(call("URI:https://reach.test/router")), undefined);
  });

  test("TLS settings name the file or setting that is wrong", () => {
    assert.throws(() => readTls({ ca: "/nonexistent/ca.pem" }, "tls"), /tls\.ca: .*cannot be read/);
    assert.throws(
      () => readTls({ ca: "/nonexistent/ca.pem", cert: "/nonexistent/cert.pem" }, "tls"),
      /tls\.cert and tls\.key go together/,
    );
    assert.throws(
      () => new AgentRuntime({ service: "a", trustDomain: "not a domain" }),
      /trustDomain/,
    );
    assert.throws(() => new AgentRuntime({ service: "a", joinToken: "bad token" }), /joinToken/);
  });
});
