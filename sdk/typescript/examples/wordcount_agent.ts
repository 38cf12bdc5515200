/**
 * An agent that serves `text.wordcount`: counts the words and characters of a request's
 * `text`. It registers with the registry of `reach dev`, answers calls routed to it, and
 * drains on Ctrl-C / SIGTERM.
 *
 *   reach dev &
 *   node build/examples/wordcount_agent.js [--registry http://127.0.0.1:7070] [--instance ID]
 *   grpcurl -plaintext -d '{"message": {"header": {"capability": "text.wordcount"},
 *     "payload": {"parts": [{"data": {"text": "the quick brown fox"}}]}}}' \
 *     127.0.0.1:7070 reach.v1.RouterService/Call
 */

import { parseArgs } from "node:util";

import { AgentRuntime, Code, dataPart, firstData, makePayload, ReachError } from "@reach-mesh/sdk";

const { values } = parseArgs({
  options: {
    registry: { type: "string", default: "http://127.0.0.1:7070" },
    instance: { type: "string" },
  },
});

await new AgentRuntime({
  service: "text.tools",
  registry: values.registry,
  instanceId: values.instance,
})
  .handle(
    {
      name: "text.wordcount",
      version: "1.0.0",
      description: "count the words and characters of a text; not for summaries or translation",
      inputSchema: {
        type: "object",
        required: ["text"],
        properties: { text: { type: "string", description: "the text to count" } },
      },
      outputSchema: {
        type: "object",
        required: ["words", "characters"],
        properties: { words: { type: "integer" }, characters: { type: "integer" } },
      },
    },
    (_ctx, message) => {
      const text = firstData(message.payload)?.text;
      if (typeof text !== "string") {
        throw new ReachError(
          Code.INVALID_ARGUMENT,
          'the request needs a data part {"text": "..."}',
        );
      }
      const words = text.split(/\s+/).filter((word) => word !== "").length;
      return makePayload(
        "text.wordcount_result",
        dataPart({ words, characters: [...text].length }),
      );
    },
  )
  .run();
