// Validates AsyncAPI documents as `asyncapi validate` does (the same parser and its spec rules),
// without the CLI's 1.5 GB of dependencies: exits 1 on any error or warning, listing each one.
//   node tools/asyncapi/validate.mjs docs/asyncapi.yaml
import { readFile } from "node:fs/promises";

import { Parser, DiagnosticSeverity } from "@asyncapi/parser";

const parser = new Parser();
let failed = false;
for (const path of process.argv.slice(2)) {
  const { document, diagnostics } = await parser.parse(await readFile(path, "utf8"), {
    source: path,
  });
  const serious = diagnostics.filter((d) => d.severity <= DiagnosticSeverity.Warning);
  for (const d of serious) {
    const level = d.severity === DiagnosticSeverity.Error ? "error" : "warning";
    console.error(`${path}: ${level} at ${d.path.join(".") || "(root)"}: ${d.message} [${d.code}]`);
  }
  if (document === undefined || serious.length > 0) failed = true;
  else console.log(`${path}: valid AsyncAPI ${document.version()}`);
}
process.exit(failed ? 1 : 0);
