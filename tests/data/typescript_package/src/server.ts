// The packed TypeScript port served by Hono on Node (@hono/node-server): the conformance agent through
// fetchHandler, as the port's README shows.  `node dist/server.js --port 0` prints
// "listening on http://127.0.0.1:PORT/dispatch"; SIGTERM closes it, letting in-flight dispatches finish.
import { serve } from "@hono/node-server";
import { Hono } from "hono";
import { fetchHandler } from "pipelines-port";

import { conformanceAgent } from "./conformance_agent.js"; // the port's own, importing "pipelines-port"

const handle = fetchHandler(conformanceAgent); // the agent token: $AGENT_TOKEN, read at each request

const app = new Hono();
app.all("/dispatch", (c) => handle(c.req.raw));
app.all("/healthz", (c) => handle(c.req.raw));

const flag = process.argv.indexOf("--port");
const port = flag < 0 ? 8080 : Number(process.argv[flag + 1]);
const server = serve({ fetch: app.fetch, hostname: "127.0.0.1", port }, (info) => {
  process.stdout.write(`listening on http://127.0.0.1:${info.port}/dispatch\n`);
});
process.once("SIGTERM", () => server.close(() => process.exit(0)));
