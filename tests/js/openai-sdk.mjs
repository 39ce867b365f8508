// The HTTP API through the official OpenAI SDK for JavaScript, as a Node.js
// application uses it: plain and streamed chat completions, the stream
// helper that assembles a completion from its chunks, completions, the
// Responses API (whole, streamed, continued), a forced tool call, and
// errors as the SDK's own classes. It reports what it saw, one JSON object
// a line; tests/e2e/test_http_api.py compares that with the Python SDK.
//
//   node openai-sdk.mjs BASE_URL API_KEY MODEL IMAGE_FILE

import fs from "node:fs";
import OpenAI from "openai";

const [baseURL, apiKey, model, imageFile] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0 });
const image = `data:image/jpeg;base64,${fs.readFileSync(imageFile).toString("base64")}`;
const QUESTION = "What is this?";
const messages = [{ role: "user", content: [{ type: "text", text: QUESTION }, { type: "image_url", image_url: { url: image } }] }];
const WEATHER = {
  type: "function",
  function: {
    name: "get_weather",
    parameters: {
      type: "object",
      properties: { city: { type: "string", maxLength: 8 } },
      required: ["city"],
      additionalProperties: false,
    },
  },
};

function report(check, fields) {
  process.stdout.write(JSON.stringify({ check, ...fields }) + "\n");
}

// What a failed call raised: the SDK's class and what it read from the body.
async function failure(call) {
  try {
    await call();
    return null;
  } catch (err) {
    return { name: err.constructor.name, status: err.status, code: err.code, param: err.param, type: err.type };
  }
}

const models = await client.models.list();
report("models", { ids: models.data.map((m) => m.id) });

const whole = await client.chat.completions.create({ model, messages, max_tokens: 8 });
report("chat", { text: whole.choices[0].message.content, finish: whole.choices[0].finish_reason, usage: whole.usage });

const stream = await client.chat.completions.create({
  model, messages, max_tokens: 8, stream: true, stream_options: { include_usage: true },
});
let text = "";
let usage = null;
for await (const chunk of stream) {
  text += chunk.choices[0]?.delta?.content ?? "";
  usage = chunk.usage ?? usage;
}
report("chat stream", { text, usage });

const helped = await client.chat.completions.stream({ model, messages, max_tokens: 8 }).finalChatCompletion();
report("stream helper", { text: helped.choices[0].message.content });

const completion = await client.completions.create({ model, prompt: "Once upon a time", max_tokens: 5 });
report("completion", { text: completion.choices[0].text });

const input = [{ role: "user", content: [{ type: "input_text", text: QUESTION }, { type: "input_image", image_url: image }] }];
const response = await client.responses.create({ model, input, max_output_tokens: 8 });
report("responses", { text: response.output_text, status: response.status });
const events = [];
const streamed = client.responses.stream({ model, input, max_output_tokens: 8 });
for await (const event of streamed) events.push(event.type);
report("responses stream", { text: (await streamed.finalResponse()).output_text, events });
const continued = await client.responses.create({ model, previous_response_id: response.id, input: "And?", max_output_tokens: 4 });
report("continued", { status: continued.status, input_tokens: continued.usage.input_tokens });

const forced = { model, messages: [{ role: "user", content: "Weather?" }], tools: [WEATHER], max_tokens: 32 };
forced.tool_choice = { type: "function", function: { name: "get_weather" } };
const called = await client.chat.completions.create(forced);
report("tool call", { finish: called.choices[0].finish_reason, calls: called.choices[0].message.tool_calls });
const assembled = await client.chat.completions.stream(forced).finalChatCompletion();
report("tool call stream", { calls: assembled.choices[0].message.tool_calls });

const corrupt = [{ role: "user", content: [{ type: "image_url", image_url: { url: image.slice(0, 400) } }] }];
report("errors", {
  bad_parameter: await failure(() => client.chat.completions.create({ model, messages, max_tokens: -1 })),
  unknown_model: await failure(() => client.chat.completions.create({ model: "no-such-model", messages })),
  corrupt_image_streamed: await failure(async () => {
    for await (const _ of await client.chat.completions.create({ model, messages: corrupt, stream: true }));
  }),
  no_key: await failure(() => new OpenAI({ baseURL, apiKey: "wrong", maxRetries: 0 }).models.list()),
});
