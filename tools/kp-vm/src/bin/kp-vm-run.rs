//! `kp-vm-run EXE [ARGS...]`: runs EXE inside the test VM, prints its output and exits with
//! its status. Usable as a cargo runner:
//! `CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER=target/debug/kp-vm-run cargo test ...`.

use std::ffi::OsString;
use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

fn main() -> ExitCode {
    let mut args = std::env::args_os().skip(1);
    let Some(exe) = args.next() else {
        eprintln!("usage: kp-vm-run EXE [ARGS...]");
        return ExitCode::from(2);
    };
    let rest: Vec<OsString> = args.collect();
    match kp_vm::Vm::from_env().run(&PathBuf::from(exe), &rest) {
        Ok(out) => {
            let _ = std::io::stdout().write_all(&out.stdout);
            let _ = std::io::stderr().write_all(&out.stderr);
            ExitCode::from(u8::try_from(out.status).unwrap_or(1))
        }
        Err(error) => {
            eprintln!("kp-vm-run: {error}");
            ExitCode::from(125)
        }
    }
}
