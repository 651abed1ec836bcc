//! Start-up scaffolding shared by the service binaries: the async runtime around `main`, and
//! the shutdown signal (logs and telemetry: [`crate::telemetry`]). Each binary keeps its own arguments and messages.

use std::future::Future;
use std::process::ExitCode;

use tokio::sync::watch;

/// Runs `main` on a multi-threaded runtime. A failure (or a runtime that will not start) is
/// printed once, with its whole context chain, and exits 1 ([`crate::cli::exit::FAILURE`]).
pub fn block_on_main(main: impl Future<Output = anyhow::Result<()>>) -> ExitCode {
    block_on_status(async move { main.await.map(|()| crate::cli::exit::OK) })
}

/// [`block_on_main`] for a `main` that chooses its exit status when it succeeds (e.g.
/// [`crate::cli::exit::REFUSED`]).
pub fn block_on_status(main: impl Future<Output = anyhow::Result<u8>>) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: starting the async runtime: {e}");
            return ExitCode::from(crate::cli::exit::FAILURE);
        }
    };
    match runtime.block_on(main) {
        Ok(status) => ExitCode::from(status),
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(crate::cli::exit::FAILURE)
        }
    }
}

/// A shutdown flag for the service's loops: it turns true at the first SIGINT or SIGTERM,
/// after `on_signal` ran (the binary logs what it will finish, under its own target). Call
/// from within the runtime.
pub fn shutdown_on_signal(on_signal: impl FnOnce() + Send + 'static) -> watch::Receiver<bool> {
    let (stop, shutdown) = watch::channel(false);
    // The handlers are installed here, before this returns: a signal that arrives while the
    // process is still starting is a shutdown too, never the default action (death).
    let signals = Signals::install();
    tokio::spawn(async move {
        signals.first().await;
        on_signal();
        let _ = stop.send(true);
    });
    shutdown
}

/// SIGINT (Ctrl-C) and, on Unix, SIGTERM (what container runtimes send), watched from the
/// moment they are installed.
struct Signals {
    #[cfg(unix)]
    interrupt: Option<tokio::signal::unix::Signal>,
    #[cfg(unix)]
    terminate: Option<tokio::signal::unix::Signal>,
}

impl Signals {
    fn install() -> Signals {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            Signals { interrupt: signal(SignalKind::interrupt()).ok(), terminate: signal(SignalKind::terminate()).ok() }
        }
        #[cfg(not(unix))]
        {
            Signals {}
        }
    }

    /// Resolves at the first of them (a signal that could not be watched never comes).
    async fn first(self) {
        #[cfg(unix)]
        {
            async fn recv(s: Option<tokio::signal::unix::Signal>) {
                match s {
                    Some(mut s) => {
                        s.recv().await;
                    }
                    None => std::future::pending().await,
                }
            }
            tokio::select! {
                _ = recv(self.interrupt) => {}
                _ = recv(self.terminate) => {}
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
