//! What the relay's loopback tests share: greeting endpoints and free ports.

use kp_core::model::Endpoint;
use kp_core::testutil::endpoint_at;
use tokio::io::AsyncWriteExt as _;
use tokio::net::TcpListener;

/// A TCP backend on 127.0.0.1 greeting each connection with `name`.
pub async fn greeter(name: &'static str) -> Endpoint {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("address");
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let _ = s.write_all(format!("{name}\n").as_bytes()).await;
        }
    });
    endpoint_at(addr.ip(), addr.port(), true)
}

/// A free TCP port on the wildcard address (so on loopback too), for a NodePort.
pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("0.0.0.0:0").expect("bind");
    listener.local_addr().expect("address").port()
}
