#!/bin/sh
# Adds VRAM Lab from this unpacked folder to the desktop's application menu, for the current user only:
#   ~/.local/share/applications/vramlab.desktop   (Exec= this folder's vramlab)
#   ~/.local/share/icons/hicolor/*/apps/vramlab.* (the icon)
#   ~/.local/bin/vramlab                          (a link, so that `vramlab estimate ...` works in a shell)
# Run it again after moving the folder. `./install-desktop-entry.sh --uninstall` removes all three.
# (The .deb package installs the same entry system-wide; this script is for the tarball.)
set -eu
here=$(cd "$(dirname "$0")" && pwd)
data=${XDG_DATA_HOME:-$HOME/.local/share}
bin=$HOME/.local/bin

if [ "${1:-}" = "--uninstall" ]; then
    rm -f "$data/applications/vramlab.desktop" "$bin/vramlab"
    find "$data/icons/hicolor" -path '*/apps/vramlab.*' -delete 2>/dev/null || true
    echo "VRAM Lab removed from the application menu."
    exit 0
fi

[ -x "$here/vramlab" ] || { echo "error: $here/vramlab not found; run this script from the unpacked folder" >&2; exit 1; }
mkdir -p "$data/applications" "$bin"
(cd "$here/share/icons" && find hicolor -type f) | while read -r icon; do
    mkdir -p "$data/icons/$(dirname "$icon")"
    cp "$here/share/icons/$icon" "$data/icons/$icon"
done
sed -e "s|^Exec=.*|Exec=\"$here/vramlab\"|" -e "s|^TryExec=.*|TryExec=$here/vramlab|" \
    "$here/share/applications/vramlab.desktop" > "$data/applications/vramlab.desktop"
ln -sf "$here/vramlab" "$bin/vramlab"
echo "VRAM Lab added to the application menu (runs $here/vramlab)."
