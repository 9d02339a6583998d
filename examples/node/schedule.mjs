// A cronbus client in Node.js, written from docs/asyncapi.yaml alone: it upserts a schedule that
// calls a webhook on a local HTTP server of its own, gets it, verifies the signed delivery with
// the standardwebhooks package, and deletes the schedule.
//
//   CRONBUS_AMQP_URL=amqp://guest:guest@127.0.0.1:5672/ CRONBUS_NAMESPACE=demo \
//   CRONBUS_SIGNING_SECRET=whsec_... node schedule.mjs
//
// CRONBUS_SIGNING_SECRET is one of the namespace's secrets in cronbus's
// CRONBUS_SIGNING_SECRETS_FILE. The webhook host must be allowed by the executor's
// CRONBUS_WEBHOOK_ALLOWED_NETWORKS (cronbus dev allows loopback).
import { randomUUID } from "node:crypto";
import { createServer } from "node:http";

import amqp from "amqplib";
import { Webhook } from "standardwebhooks";

const amqpUrl = process.env.CRONBUS_AMQP_URL ?? "amqp://guest:guest@127.0.0.1:5672/";
const namespace = process.env.CRONBUS_NAMESPACE ?? "demo";
const secret = process.env.CRONBUS_SIGNING_SECRET;
const scheduleId = process.env.SCHEDULE_ID ?? `node-${randomUUID()}`;
const timeoutMs = Number(process.env.TIMEOUT_MS ?? 30000);
if (!secret) throw new Error("CRONBUS_SIGNING_SECRET: not set (a whsec_ secret of the namespace)");

// channels.replies: direct reply-to, so no queue to declare.
const REPLY_TO = "amq.rabbitmq.reply-to";

function listen(onDelivery) {
  const server = createServer((request, response) => {
    const chunks = [];
    request.on("data", (chunk) => chunks.push(chunk));
    request.on("end", () => {
      response.writeHead(200).end();
      onDelivery({ body: Buffer.concat(chunks).toString("utf8"), headers: request.headers });
    });
  });
  return new Promise((resolve) => server.listen(0, "127.0.0.1", () => resolve(server)));
}

async function connect() {
  const connection = await amqp.connect(amqpUrl);
  const channel = await connection.createChannel();
  const waiting = new Map();
  await channel.consume(
    REPLY_TO,
    (message) => {
      const settle = waiting.get(message.properties.correlationId);
      waiting.delete(message.properties.correlationId);
      settle?.(JSON.parse(message.content.toString("utf8")));
    },
    { noAck: true },
  );
  // operations.sendCommand: publish to cronbus.commands, routing key <namespace>.<verb>; the
  // reply comes back with the command's correlation_id.
  const command = (verb, body) =>
    new Promise((resolve, reject) => {
      const correlationId = randomUUID();
      const timer = setTimeout(() => reject(new Error(`${verb}: no reply`)), timeoutMs);
      waiting.set(correlationId, (reply) => {
        clearTimeout(timer);
        if (reply.ok) resolve(reply);
        else reject(new Error(`${verb}: ${reply.error.code}: ${JSON.stringify(reply.error)}`));
      });
      channel.publish("cronbus.commands", `${namespace}.${verb}`, Buffer.from(JSON.stringify(body)), {
        contentType: "application/json",
        replyTo: REPLY_TO,
        correlationId,
        messageId: randomUUID(),
      });
    });
  return { connection, command };
}

function firstDelivery() {
  let received;
  const delivered = new Promise((resolve) => (received = resolve));
  return { delivered, received };
}

const { delivered, received } = firstDelivery();
const server = await listen(received);
const { connection, command } = await connect();
try {
  const at = new Date(Math.ceil(Date.now() / 1000) * 1000 + 2000).toISOString().replace(".000Z", "Z");
  const upserted = await command("upsert", {
    schedule: {
      id: scheduleId,
      spec: { kind: "once", at },
      target: {
        kind: "webhook",
        url: `http://127.0.0.1:${server.address().port}/hook`,
        method: "POST",
        body: { from: "node" },
      },
      labels: { example: "node" },
    },
  });
  console.log(`upserted ${scheduleId} version=${upserted.schedule.version}`);

  const got = await command("get", { id: scheduleId });
  console.log(`got state=${got.schedule.state} next_fires=${got.schedule.next_fires.join(",")}`);

  const timer = setTimeout(() => {
    throw new Error("no webhook delivery");
  }, timeoutMs);
  const delivery = await delivered;
  clearTimeout(timer);
  // Throws WebhookVerificationError unless the signature is the secret's.
  const payload = new Webhook(secret).verify(delivery.body, delivery.headers);
  console.log(
    `verified webhook-id=${delivery.headers["webhook-id"]} ` +
      `schedule=${delivery.headers["x-cronbus-schedule"]} body=${JSON.stringify(payload)}`,
  );

  const deleted = await command("delete", { id: scheduleId });
  console.log(`deleted ${scheduleId} state=${deleted.schedule?.state ?? "deleted"}`);
} finally {
  await connection.close();
  server.close();
}
