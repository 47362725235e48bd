# Generated bindings of proto/microserving/v1 live here; regenerate with scripts/gen_proto.sh.
