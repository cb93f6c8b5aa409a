; Inno Setup script of VRAM Lab (Windows installer). Not built on the Linux CI; run on Windows:
;
;   python packaging\build.py --variant full        (builds dist\vramlab-<version>-windows-amd64-full\
;                                                    and, when ISCC.exe is found, runs this script)
; or by hand, after build.py:
;   "C:\Program Files (x86)\Inno Setup 6\ISCC.exe" /DAppVersion=0.1.0 /DVariant=full ^
;       /DSourceDir=dist\vramlab-0.1.0-windows-amd64-full /DOutputDir=dist packaging\windows\vramlab.iss
;
; The folder holds vramlab.exe (console: the CLI, `vramlab estimate ...`) and vramlab-gui.exe (windowed:
; the shortcuts), both from packaging/vramlab.spec. Installs per user by default (no admin prompt);
; the user can choose a machine-wide install in the dialog.

#ifndef AppVersion
  #define AppVersion "0.1.0"
#endif
#ifndef Variant
  #define Variant "full"
#endif
#ifndef SourceDir
  #error Pass /DSourceDir=<the folder that build.py made>
#endif
#ifndef OutputDir
  #define OutputDir "."
#endif

[Setup]
; one AppId for both variants: installing one replaces the other
AppId={{6C0E0B57-5F3A-4C55-9D8B-3A1C9E7B2F10}
AppName=VRAM Lab
AppVersion={#AppVersion}
AppVerName=VRAM Lab {#AppVersion} ({#Variant})
AppPublisher=VRAM Lab
DefaultDirName={autopf}\VRAM Lab
DefaultGroupName=VRAM Lab
DisableProgramGroupPage=yes
PrivilegesRequired=lowest
PrivilegesRequiredOverridesAllowed=dialog
ArchitecturesAllowed=x64compatible
ArchitecturesInstallIn64BitMode=x64compatible
OutputDir={#OutputDir}
OutputBaseFilename=vramlab-{#AppVersion}-windows-amd64-{#Variant}-setup
SetupIconFile={#SourceDir}\vramlab.ico
UninstallDisplayIcon={app}\vramlab-gui.exe
Compression=lzma2/normal
SolidCompression=yes
WizardStyle=modern
ChangesEnvironment=yes
VersionInfoVersion={#AppVersion}
VersionInfoProductName=VRAM Lab

[Tasks]
Name: "desktopicon"; Description: "{cm:CreateDesktopIcon}"; GroupDescription: "{cm:AdditionalIcons}"; Flags: unchecked
Name: "addtopath"; Description: "Add vramlab to PATH (for the command line)"; Flags: unchecked

[Files]
Source: "{#SourceDir}\*"; DestDir: "{app}"; Flags: ignoreversion recursesubdirs createallsubdirs

[Icons]
Name: "{autoprograms}\VRAM Lab"; Filename: "{app}\vramlab-gui.exe"
Name: "{autodesktop}\VRAM Lab"; Filename: "{app}\vramlab-gui.exe"; Tasks: desktopicon

[Registry]
Root: HKA; Subkey: "{code:EnvKey}"; ValueType: expandsz; ValueName: "Path"; ValueData: "{olddata};{app}"; \
    Tasks: addtopath; Check: NotOnPath(ExpandConstant('{app}'))

[Run]
Filename: "{app}\vramlab-gui.exe"; Description: "{cm:LaunchProgram,VRAM Lab}"; Flags: nowait postinstall skipifsilent

[Code]
function EnvKey(Param: String): String;
begin
  if IsAdminInstallMode then
    Result := 'SYSTEM\CurrentControlSet\Control\Session Manager\Environment'
  else
    Result := 'Environment';
end;

function NotOnPath(Dir: String): Boolean;
var
  Path: String;
  Root: Integer;
begin
  if IsAdminInstallMode then Root := HKEY_LOCAL_MACHINE else Root := HKEY_CURRENT_USER;
  if not RegQueryStringValue(Root, EnvKey(''), 'Path', Path) then
    Result := True
  else
    Result := Pos(';' + Uppercase(Dir) + ';', ';' + Uppercase(Path) + ';') = 0;
end;
