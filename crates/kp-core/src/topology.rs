//! Endpoint selection, as upstream's `CategorizeEndpoints`: which endpoints a service port may
//! send traffic to on this node, given traffic policies, topology hints and terminating
//! endpoints.
