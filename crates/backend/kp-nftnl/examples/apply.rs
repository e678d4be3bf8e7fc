//! Apply an nft script (stdin) over netlink as one transaction, and print how long the
//! translation and the transaction took: the netlink counterpart of `time nft -f -`.
//!
//! `ip netns exec NS cargo run --release -p kp-nftnl --example apply < script.nft`

use std::io::Read;
use std::process::ExitCode;
use std::time::Instant;

fn main() -> ExitCode {
    let mut script = String::new();
    if let Err(err) = std::io::stdin().read_to_string(&mut script) {
        eprintln!("reading stdin: {err}");
        return ExitCode::FAILURE;
    }
    let start = Instant::now();
    let commands = match kp_nftnl::parse_script(&script) {
        Ok(commands) => commands,
        Err(err) => {
            eprintln!("{err}");
            return ExitCode::FAILURE;
        }
    };
    let parsed = start.elapsed();
    let mut socket = match kp_nftnl::NftSocket::open() {
        Ok(socket) => socket,
        Err(err) => {
            eprintln!("{err}");
            return ExitCode::FAILURE;
        }
    };
    let sent = Instant::now();
    if let Err(err) = socket.apply(&commands) {
        eprintln!("{err}");
        return ExitCode::FAILURE;
    }
    println!(
        "{} statements: translate {parsed:?}, encode + kernel {:?}",
        commands.len(),
        sent.elapsed()
    );
    ExitCode::SUCCESS
}
