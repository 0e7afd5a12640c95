// The Worker of the port's README under workerd, through miniflare, on 127.0.0.1, as `wrangler dev` runs it:
// `node workers.mjs DIR --port 0` reads DIR/wrangler.jsonc (the README's, as printed) for the compatibility date
// and flags, loads the Worker's modules compiled by tsc into DIR/dist (the bare "pipelines-port" is the installed
// package's module, which wrangler's bundler would inline), binds AGENT_TOKEN as a secret, and prints
// "listening on http://127.0.0.1:PORT/dispatch".  On SIGTERM miniflare's own exit hook disposes of workerd.
import { readFileSync, readdirSync } from "node:fs";
import path from "node:path";
import { Miniflare } from "miniflare";

const dir = path.resolve(process.argv[2]);
const flag = process.argv.indexOf("--port");
const config = JSON.parse(readFileSync(path.join(dir, "wrangler.jsonc"), "utf8"));
const dist = path.join(dir, "dist");
const main = path.join(dist, path.basename(config.main).replace(/\.ts$/, ".js"));
const pkg = JSON.parse(readFileSync(path.resolve("node_modules/pipelines-port/package.json"), "utf8"));
const modules = [main, ...readdirSync(dist).map((f) => path.join(dist, f)).filter((f) => f.endsWith(".js") && f !== main)]
  .map((file) => ({ type: "ESModule", path: file }));
modules.push({ type: "ESModule", path: path.join(dist, pkg.name),
  contents: readFileSync(path.resolve("node_modules", pkg.name, pkg.exports["."].default), "utf8") });

const mf = new Miniflare({
  host: "127.0.0.1",
  port: flag < 0 ? 8787 : Number(process.argv[flag + 1]),
  modulesRoot: dist,
  modules,
  compatibilityDate: config.compatibility_date,
  compatibilityFlags: config.compatibility_flags,
  bindings: { AGENT_TOKEN: process.env.AGENT_TOKEN ?? "" },
});
const url = await mf.ready;
console.log(`listening on ${url}dispatch`);
