//! `kp-echo`: kp-testbed's echo server and flow prober (see [`kp_testbed::tool`]).

fn main() -> std::process::ExitCode {
    kp_testbed::tool::main(std::env::args_os())
}
