// Checks KEDA objects against KEDA's own CRD schema, as @kubernetes-models/keda compiled it
// (ajv) from the CRDs of a KEDA release (its package.json names the release file).
// stdin: a JSON array of manifests. stdout: a JSON array with, for each manifest in order, the
// list of what the schema rejects in it ([] when it is valid).
"use strict";

const fs = require("node:fs");
const keda = require("@kubernetes-models/keda/keda.sh/v1alpha1");

function problems(doc) {
  const Model = keda[doc.kind];
  // Only the kinds KEDA's CRDs define: a typo in `kind` is an error, not a pass.
  if (doc.apiVersion !== "keda.sh/v1alpha1" || typeof Model !== "function") {
    return [`no KEDA CRD defines ${doc.apiVersion} ${doc.kind}`];
  }
  try {
    // The model keeps the manifest's own apiVersion and kind; the schema checks both.
    new Model(doc).validate();
    return [];
  } catch (err) {
    if (!Array.isArray(err.errors)) throw err;
    return err.errors.map((e) => {
      const allowed = e.params && e.params.allowedValues;
      return `${e.instancePath || "/"}: ${e.message}${allowed ? ` ${JSON.stringify(allowed)}` : ""}`;
    });
  }
}

const docs = JSON.parse(fs.readFileSync(0, "utf8"));
process.stdout.write(JSON.stringify(docs.map(problems)));
