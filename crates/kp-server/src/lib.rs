//! HTTP servers (TODO)
