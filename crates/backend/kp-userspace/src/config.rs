//! The relay's tunables, with documented defaults.

use std::ops::RangeInclusive;
use std::time::Duration;

/// First connect attempt's timeout. Inside a cluster a connect takes well under a
/// millisecond, so a backend that has not answered in 250 ms is likelier dead than slow;
/// upstream's userspace proxy started its dial back-off at the same value.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_millis(250);

/// Each further attempt (to the next endpoint) waits twice as long, up to this, so a slow
/// but live backend still gets a fair chance when every endpoint is slow.
pub const DEFAULT_MAX_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// A UDP session without a datagram either way for this long ends. Upstream's `--udp-timeout`
/// default for its userspace proxy; short because a session holds a socket and a task.
pub const DEFAULT_UDP_IDLE_TIMEOUT: Duration = Duration::from_millis(250);

/// Open TCP connections per service, over all its ports, families and scopes. Each holds
/// two sockets and, with splice, two pipes: six descriptors, so one service at the cap holds
/// about 24k; the cap keeps one busy service from taking the descriptors and memory that
/// every other service of the node needs.
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;

/// Live UDP sessions per service, for the same reason (each holds a socket and a task).
pub const DEFAULT_MAX_UDP_SESSIONS: usize = 4096;

/// Copy buffer per direction of a TCP connection copied through user space. 64 KiB lets one
/// read move a full segment-offload burst; held for the connection's lifetime.
pub const DEFAULT_BUFFER_BYTES: usize = 64 * 1024;

/// Pipe size per direction with splice(2): the kernel's default `pipe-max-size`. Larger
/// pipes move more per wake-up, which matters when the relay waits for a CPU: 0.61× vs 0.50×
/// direct on one stream, 0.69× vs 0.62× on four, against 64 KiB pipes (`kp-datapath`, load
/// ~9, one run of 3 rounds each; an earlier comparison had the 64 KiB switch set the wrong
/// field). Pages are only held while data is in flight.
pub const DEFAULT_PIPE_BYTES: usize = 1024 * 1024;

/// Copy with splice(2) on Linux: measured with `kp-datapath` (see `bench/notes/`, 2026-11-23 to 2026-11-25).
pub const DEFAULT_SPLICE: bool = true;

/// TCP_NODELAY on both sockets of a relayed connection: a request or an ack a protocol
/// waits for must not sit in Nagle's buffer for a round trip on either hop.
pub const DEFAULT_NODELAY: bool = true;

/// Largest UDP payload (IPv4's 65,535-byte datagram minus headers; IPv6 jumbograms aside).
pub(crate) const MAX_DATAGRAM: usize = 65_535;

/// How the relay behaves; build with [`RelayConfig::default`] and the `with_*` methods.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RelayConfig {
    /// First connect attempt's timeout ([`DEFAULT_CONNECT_TIMEOUT`]).
    pub connect_timeout: Duration,
    /// Cap of the doubling connect timeout ([`DEFAULT_MAX_CONNECT_TIMEOUT`]).
    pub max_connect_timeout: Duration,
    /// UDP session idle timeout ([`DEFAULT_UDP_IDLE_TIMEOUT`]).
    pub udp_idle_timeout: Duration,
    /// Open TCP connections per service ([`DEFAULT_MAX_CONNECTIONS`]).
    pub max_connections: usize,
    /// Live UDP sessions per service ([`DEFAULT_MAX_UDP_SESSIONS`]).
    pub max_udp_sessions: usize,
    /// Copy buffer per direction without splice ([`DEFAULT_BUFFER_BYTES`]).
    pub buffer_bytes: usize,
    /// Pipe size per direction with splice ([`DEFAULT_PIPE_BYTES`]).
    pub pipe_bytes: usize,
    /// Linux: copy TCP payload with splice(2) through a pipe instead of user-space buffers
    /// ([`DEFAULT_SPLICE`]). Ignored elsewhere.
    pub splice: bool,
    /// TCP_NODELAY on both sockets of a relayed connection ([`DEFAULT_NODELAY`]).
    pub nodelay: bool,
    /// The ports frontends listen on (upstream's `--proxy-port-range`); `None` (the default)
    /// lets the kernel pick ephemeral ports.
    pub port_range: Option<RangeInclusive<u16>>,
}

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            max_connect_timeout: DEFAULT_MAX_CONNECT_TIMEOUT,
            udp_idle_timeout: DEFAULT_UDP_IDLE_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_udp_sessions: DEFAULT_MAX_UDP_SESSIONS,
            buffer_bytes: DEFAULT_BUFFER_BYTES,
            pipe_bytes: DEFAULT_PIPE_BYTES,
            splice: DEFAULT_SPLICE,
            nodelay: DEFAULT_NODELAY,
            port_range: None,
        }
    }
}

impl RelayConfig {
    /// Sets the first connect attempt's timeout.
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Sets the UDP idle timeout.
    pub fn with_udp_idle_timeout(mut self, timeout: Duration) -> Self {
        self.udp_idle_timeout = timeout;
        self
    }

    /// Sets the per-service cap on open TCP connections.
    pub fn with_max_connections(mut self, max: usize) -> Self {
        self.max_connections = max;
        self
    }

    /// Sets the per-service cap on UDP sessions.
    pub fn with_max_udp_sessions(mut self, max: usize) -> Self {
        self.max_udp_sessions = max;
        self
    }

    /// Sets the copy buffer size per direction.
    pub fn with_buffer_bytes(mut self, bytes: usize) -> Self {
        self.buffer_bytes = bytes;
        self
    }

    /// Sets the splice pipe size per direction.
    pub fn with_pipe_bytes(mut self, bytes: usize) -> Self {
        self.pipe_bytes = bytes;
        self
    }

    /// Turns splice(2) copying on or off (Linux only).
    pub fn with_splice(mut self, splice: bool) -> Self {
        self.splice = splice;
        self
    }

    /// Turns TCP_NODELAY on the relayed connections on or off.
    pub fn with_nodelay(mut self, nodelay: bool) -> Self {
        self.nodelay = nodelay;
        self
    }

    /// Sets the ports frontends listen on; `None` for ephemeral ports.
    pub fn with_port_range(mut self, range: Option<RangeInclusive<u16>>) -> Self {
        self.port_range = range;
        self
    }

    /// The timeout of connect attempt `attempt` (0-based): doubling from
    /// `connect_timeout`, capped at `max_connect_timeout`.
    pub fn attempt_timeout(&self, attempt: usize) -> Duration {
        let factor = 1u32 << attempt.min(16);
        self.connect_timeout
            .saturating_mul(factor)
            .min(self.max_connect_timeout.max(self.connect_timeout))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attempt_timeouts_double_up_to_the_cap() {
        let c = RelayConfig::default();
        let ms: Vec<u128> = (0..6).map(|a| c.attempt_timeout(a).as_millis()).collect();
        assert_eq!(ms, vec![250, 500, 1000, 2000, 2000, 2000]);
        assert_eq!(c.attempt_timeout(usize::MAX), Duration::from_secs(2));
    }
}
